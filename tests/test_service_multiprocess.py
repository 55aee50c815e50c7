"""One `serve-base` process, several client processes at their own pace, faults on the side.

Three clients with different PEFT methods (one fine-tuning over TCP, two generating with
different batch sizes and lengths over shared memory and IPC) each match what the same
adapter computes in vanilla transformers + peft in that client's own process, while
another client is killed with SIGKILL in the middle of its layer calls, one disconnects
mid-call, random bytes and truncated frames hit the port, and a client built from another
checkpoint is refused. Clients start with `spawn` (forking after torch started its thread
pool can hang the child).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import zmq

import symbiont
from symbiont.processes import ServerProcess
from symbiont.protocol.executor import PROTOCOL_VERSION, ExecutorError
from symbiont.protocol.wire import Call, Hello, encode

GENERATE = dict(do_sample=False, pad_token_id=0)


def _peft_config(method: str):
    import peft

    targets = ["q_proj", "v_proj"]
    if method == "lora":
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    if method == "ia3":
        return peft.IA3Config(
            target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        )
    return peft.LoHaConfig(r=4, target_modules=targets)


def _pair(path, executor, method):
    """(vanilla, split) peft models with the same non-trivial adapter weights."""
    import peft
    from transformers import AutoModelForCausalLM

    config = _peft_config(method)
    torch.manual_seed(1)
    vanilla = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), config)
    with torch.no_grad():
        for param in vanilla.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    split = peft.get_peft_model(symbiont.load_client(path, executor), config)
    trained = dict(split.named_parameters())
    with torch.no_grad():
        for name, param in vanilla.named_parameters():
            if param.requires_grad:
                trained[name].copy_(param)
    return vanilla, split


def _ids(seed, rows, length):
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(seed))


def _finetune(model, ids, steps=3):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def client_job(job: dict, path: str, url: str, results) -> None:
    """Runs in a spawned process: the split model against the service, then vanilla alone."""
    torch.set_num_threads(1)
    try:
        executor = symbiont.connect(url, mode=job["mode"], checkpoint=path, label=job["name"])
        vanilla, split = _pair(path, executor, job["method"])
        ids = _ids(job["seed"], job["rows"], job["length"])
        if job["kind"] == "finetune":
            got, want = _finetune(split.train(), ids), _finetune(vanilla.train(), ids)
            ok = torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
        else:
            with torch.no_grad():
                gen = dict(GENERATE, max_new_tokens=job["new"])
                got = split.eval().generate(input_ids=ids, **gen).tolist()
                want = vanilla.eval().generate(input_ids=ids, **gen).tolist()
            ok = got == want
        results.put({"name": job["name"], "ok": ok, "got": got, "want": want})
        executor.close()
    except Exception as err:  # noqa: BLE001 - report any failure to the test process
        results.put({"name": job["name"], "ok": False, "error": repr(err)})


def victim_job(path: str, url: str, ready) -> None:
    """Calls the biggest layer over and over until it is killed (SIGKILL from the test)."""
    torch.set_num_threads(1)
    executor = symbiont.connect(url, mode="shm", label="victim")
    spec = max(executor.manifest.layers, key=lambda s: s.out_features)
    x = torch.randn(4096, spec.in_features)
    executor.forward(spec.id, x)
    ready.put(os.getpid())
    while True:
        executor.forward(spec.id, x)


JOBS = [
    dict(
        name="finetune-lora",
        kind="finetune",
        method="lora",
        mode="zmq",
        scheme="tcp",
        seed=1,
        rows=4,
        length=12,
    ),
    dict(
        name="generate-ia3",
        kind="generate",
        method="ia3",
        mode="shm",
        scheme="ipc",
        seed=2,
        rows=1,
        length=5,
        new=12,
    ),
    dict(
        name="generate-loha",
        kind="generate",
        method="loha",
        mode="zmq",
        scheme="ipc",
        seed=3,
        rows=3,
        length=9,
        new=6,
    ),
]


def _abuse_the_port(server: ServerProcess, other_checkpoint: Path) -> None:
    """Random bytes, truncated frames, a mid-call disconnect, another checkpoint."""
    host, port = server.url("tcp").removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(os.urandom(2048))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url("tcp"))
    sock.send_multipart([encode(Hello(call_id=1, protocol=PROTOCOL_VERSION))])
    truncated = Call(call_id=2, op=1, layer=0, rows=3, cols=32, dtype="float32")
    sock.send_multipart([encode(truncated), b"\x00" * 17])
    whole = Call(call_id=3, op=1, layer=0, rows=512, cols=32, dtype="float32")
    sock.send_multipart([encode(whole), bytes(512 * 32 * 4)])
    sock.close()  # gone before its answer
    with pytest.raises(ExecutorError, match="fingerprint"):
        symbiont.connect(server.url("tcp"), checkpoint=other_checkpoint)


def test_independent_clients_with_faults_around_them(checkpoints):
    path = checkpoints("llama")
    spawn = multiprocessing.get_context("spawn")
    results, ready = spawn.Queue(), spawn.Queue()
    with ServerProcess(path, args=("--threads", "1")) as server:
        victim = spawn.Process(target=victim_job, args=(str(path), server.url("ipc"), ready))
        victim.start()
        clients = [
            spawn.Process(
                target=client_job, args=(job, str(path), server.url(job["scheme"]), results)
            )
            for job in JOBS
        ]
        for process in clients:
            process.start()
        ready.get(timeout=120)
        time.sleep(0.3)
        os.kill(victim.pid, signal.SIGKILL)  # in the middle of one of its layer calls
        _abuse_the_port(server, checkpoints("gpt2"))
        outcomes = {r["name"]: r for r in (results.get(timeout=240) for _ in JOBS)}
        for process in clients:
            process.join(30)
        victim.join(5)
        for name, outcome in outcomes.items():
            assert outcome["ok"], f"{name} differs from its vanilla run or failed: {outcome}"

        with symbiont.connect(server.url("tcp"), mode="zmq") as probe:
            deadline = time.monotonic() + 10
            while "victim" in [c["label"] for c in probe.stats()["clients"]]:
                assert time.monotonic() < deadline, "the killed client's session was never freed"
                time.sleep(0.2)
            stats = probe.stats()
        # the other checkpoint's HELLO, refused (counted there, no longer under errors too)
        assert stats["refused"] >= 1 and stats["total"]["calls"] > 0
        assert server.proc.poll() is None, f"serve-base died:\n{server.log_text()}"
        ipc_path = server.url("ipc").removeprefix("ipc://")
        assert server.stop() == 0, f"serve-base did not exit cleanly:\n{server.log_text()}"
    log = server.log_text()
    assert "serving" in log and "stopped" in log, log
    assert not Path(ipc_path).exists(), "the IPC socket file was left behind"


def test_serve_base_pinned_to_a_core_keeps_every_thread_there(checkpoints, one_thread):
    # Pinned to one core, serve-base runs one torch thread: so does this process's
    # reference (another thread count may change BLAS's summation order).
    core = min(os.sched_getaffinity(0))
    path = checkpoints("llama")
    with ServerProcess(path, args=["--cpus", str(core)]) as server:
        base = symbiont.BaseExecutor.from_pretrained(path)
        with symbiont.connect(server.url("ipc"), mode="zmq") as executor:
            x = torch.randn(5, 32)
            assert torch.equal(executor.forward(0, x), base.forward(0, x))
        tasks = list(Path(f"/proc/{server.proc.pid}/task").iterdir())
        assert len(tasks) > 1, "serve-base runs ZeroMQ and torch threads beside its loop"
        for task in tasks:
            status = (task / "status").read_text()
            allowed = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
            assert allowed.split()[-1] == str(core), f"thread {task.name}: {allowed}"


def test_serve_base_cpus_errors_name_the_usable_cores(capsys):
    from symbiont.base.config import parse_cpus
    from symbiont.cli import main

    usable = os.sched_getaffinity(0)
    assert parse_cpus(",".join(map(str, usable))) == usable
    for text, message in [
        ("first", "use core numbers like 0"),
        (str(max(usable) + 1000), "lets us use cores"),
    ]:
        with pytest.raises(SystemExit):  # argparse: usage line, the message, exit status 2
            main(["serve-base", "--model", "m", "--cpus", text])
        assert message in capsys.readouterr().err


def staller_job(path: str, url: str, ready, go_on, results) -> None:
    """Calls every layer in turn until the test stops it (SIGSTOP) mid-loop; once resumed
    (SIGCONT, and `go_on` says so) its answers must still be right."""
    torch.set_num_threads(1)
    try:
        base = symbiont.BaseExecutor.from_pretrained(path)
        layers = base.manifest.layers
        x = torch.randn(8, max(s.in_features for s in layers))
        with symbiont.connect(url, mode="shm", label="staller") as executor:
            calls = 0
            while go_on.empty():
                spec = layers[calls % len(layers)]
                executor.forward(spec.id, x[:, : spec.in_features])
                calls += 1
                if calls == 20:
                    ready.put(os.getpid())
            # within fp32 rounding, not bitwise: the transport fuses calls fed one tensor
            # (one matmul over sibling layers sums in another order than one layer's)
            wrong = []  # (layer, largest difference, largest value): says what went wrong
            for s in layers:
                got = executor.forward(s.id, x[:, : s.in_features])
                want = base.forward(s.id, x[:, : s.in_features])
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    wrong.append((s.name, float((got - want).abs().max()), float(want.abs().max())))
        results.put({"name": "staller", "ok": not wrong, **({"wrong": wrong} if wrong else {})})
    except Exception as err:  # noqa: BLE001 - report any failure to the test process
        ready.put(None)
        results.put({"name": "staller", "ok": False, "error": repr(err)})


@pytest.mark.parametrize("policy", ["opportunistic", "lockstep"])
def test_a_stalled_client_does_not_hold_the_others(checkpoints, policy):
    path = checkpoints("llama")
    spawn = multiprocessing.get_context("spawn")
    ready, go_on, results = spawn.Queue(), spawn.Queue(), spawn.Queue()
    with ServerProcess(path, args=("--threads", "1", "--policy", policy)) as server:
        staller = spawn.Process(
            target=staller_job, args=(str(path), server.url("ipc"), ready, go_on, results)
        )
        staller.start()
        assert ready.get(timeout=120) is not None, results.get(timeout=5)
        os.kill(staller.pid, signal.SIGSTOP)  # stalls between (or in) its layer calls
        try:
            job = JOBS[1]
            client = spawn.Process(
                target=client_job, args=(job, str(path), server.url(job["scheme"]), results)
            )
            client.start()
            outcome = results.get(timeout=180)
            client.join(30)
            assert outcome["ok"], f"a client beside a stalled one failed: {outcome}"
            status = Path(f"/proc/{staller.pid}/status").read_text()
            assert "stopped" in status, "the staller ran on: the test proves nothing"
        finally:
            go_on.put(True)
            os.kill(staller.pid, signal.SIGCONT)
        assert results.get(timeout=60) == {"name": "staller", "ok": True}
        staller.join(30)
        assert server.proc.poll() is None, server.log_text()


def test_a_client_cannot_shrink_its_segment_under_the_executor(checkpoints, one_thread):
    """Issue 11 #6: a client that truncated the segment the executor maps killed it with
    SIGBUS. The executor now creates and seals every segment: truncation is refused by
    the kernel, whoever tries, and the executor goes on serving."""
    path = checkpoints("llama")
    base = symbiont.BaseExecutor.from_pretrained(path)
    with ServerProcess(path, args=("--threads", "1")) as server:
        with symbiont.connect(server.url("ipc"), mode="shm") as executor:
            x = torch.randn(3, 32)
            assert torch.equal(executor.forward(0, x), base.forward(0, x))
            fds = Path(f"/proc/{server.proc.pid}/fd")
            segments = [fd for fd in fds.iterdir() if "memfd:symbiont" in os.readlink(fd)]
            assert segments, "the executor owns no memfd segment"
            for fd_path in segments:
                fd = os.open(fd_path, os.O_RDWR)  # what the client itself opens
                try:
                    for size in (0, 1, 1 << 30):
                        with pytest.raises(PermissionError):
                            os.ftruncate(fd, size)
                finally:
                    os.close(fd)
            for rows in (3, 200):  # the second grows the segment: a new sealed one
                x = torch.randn(rows, 32)
                assert torch.equal(executor.forward(0, x), base.forward(0, x))
        assert server.proc.poll() is None, f"serve-base died:\n{server.log_text()}"


def test_a_killed_executor_is_named_as_gone_not_as_slow(checkpoints):
    """Issue 11 #9: after kill -9 of serve-base the client said it waited `timeout_s` per
    attempt; it says the connection to that URL was lost and what to do."""
    path = checkpoints("llama")
    server = ServerProcess(path, args=("--threads", "1")).start()
    try:
        url = server.url("tcp")
        executor = symbiont.connect(url, mode="zmq", connect_timeout_s=1, retries=1)
        executor.forward(0, torch.zeros(1, 32))
        server.proc.kill()
        server.proc.wait()
        start = time.monotonic()
        with pytest.raises(symbiont.ExecutorUnavailable) as caught:
            executor.forward(0, torch.zeros(1, 32))
        assert time.monotonic() - start < 10, "it waited for timeout_s on a dead connection"
        message = str(caught.value)
        assert "lost the base executor at " + url in message and "dropped" in message
        assert "start `symbiont serve-base`" in message
        assert "timeout_s=60" not in message, message
        executor.close()
    finally:
        server.stop()
        shutil.rmtree(server.folder, ignore_errors=True)  # kept: it was killed, not stopped


def _pss_bytes(pid: int) -> int:
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return 1024 * int(next(ln for ln in rollup.splitlines() if ln.startswith("Pss:")).split()[1])


def test_a_huge_message_without_a_session_is_refused_before_it_is_read(checkpoints):
    """Issue 11 #8: a 1 GiB frame from a peer that never said HELLO was read and allocated
    in full; now no frame over MAX_FRAME_BYTES is read at all (ZeroMQ drops the peer)."""
    path = checkpoints("llama")
    base = symbiont.BaseExecutor.from_pretrained(path)
    with ServerProcess(path, args=("--threads", "1")) as server:
        before = _pss_bytes(server.proc.pid)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.url("tcp"))
        huge = Call(call_id=1, op=1, layer=0, rows=(1 << 30) // 128, cols=32, dtype="float32")
        sock.send_multipart([encode(huge), bytes(1 << 30)])
        time.sleep(3)  # time enough to push 1 GiB through loopback
        grown = _pss_bytes(server.proc.pid) - before
        sock.close()
        assert grown < 64 << 20, f"serve-base grew by {grown >> 20} MiB"
        with symbiont.connect(server.url("tcp"), mode="zmq") as executor:
            x = torch.randn(3, 32)
            assert torch.allclose(executor.forward(0, x), base.forward(0, x), atol=1e-6)
        assert server.proc.poll() is None, server.log_text()

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
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
import zmq

import symbiont
from symbiont.executor.interface import PROTOCOL_VERSION, ExecutorError
from symbiont.service.process import ServerProcess
from symbiont.transport.wire import Kind, pack

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
    sock.send_multipart([pack(Kind.HELLO, 1, {"protocol": PROTOCOL_VERSION})])
    sock.send_multipart([pack(Kind.CALL, 2, 1, 0, 3, 32, "float32"), b"\x00" * 17])  # truncated
    sock.send_multipart([pack(Kind.CALL, 3, 1, 0, 512, 32, "float32"), bytes(512 * 32 * 4)])
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
        assert stats["errors"] >= 1 and stats["total"]["calls"] > 0
        assert server.proc.poll() is None, f"serve-base died:\n{server.log_text()}"
        ipc_path = server.url("ipc").removeprefix("ipc://")
        assert server.stop() == 0, f"serve-base did not exit cleanly:\n{server.log_text()}"
    log = server.log_text()
    assert "serving" in log and "stopped" in log, log
    assert not Path(ipc_path).exists(), "the IPC socket file was left behind"


def test_serve_base_pinned_to_a_core_keeps_every_thread_there(checkpoints):
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


def test_serve_base_cpus_errors_name_the_usable_cores():
    import argparse

    from symbiont.cli.serve_base import _cpu_list

    usable = os.sched_getaffinity(0)
    assert _cpu_list(",".join(map(str, usable))) == usable
    with pytest.raises(argparse.ArgumentTypeError, match="use core numbers like 0"):
        _cpu_list("first")
    with pytest.raises(argparse.ArgumentTypeError, match="lets us use cores"):
        _cpu_list(str(max(usable) + 1000))


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
            ok = all(
                torch.equal(
                    executor.forward(s.id, x[:, : s.in_features]),
                    base.forward(s.id, x[:, : s.in_features]),
                )
                for s in layers
            )
        results.put({"name": "staller", "ok": ok})
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

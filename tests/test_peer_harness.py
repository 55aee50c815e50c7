"""The vLLM-CPU peer harness (benchmarks/peers/vllm_cpu.py) without vLLM: the parts that
decide whether its ratios are fair, and its clean skip where the peer cannot be had."""

from __future__ import annotations

import importlib.util
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location(
        "vllm_cpu_harness", REPO / "benchmarks" / "peers" / "vllm_cpu.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _args(**kw):
    base = dict(
        seed=0, rate=8.0, requests=12, zipf=1.0, short=(16, 64), long=(384, 640),
        output_len=(32, 96),
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_no_prompt_is_sent_twice_to_one_server(harness):
    """Every scenario of one server (closed and Poisson, short and long) and its warm-up
    get prompts of their own: vLLM would serve a repeated prompt from its prefix cache.
    Before session 13 the closed and Poisson scenarios of one length shared prompts."""
    bench = harness.load_serve_bench()
    scenarios = [
        harness.Scenario(8, load, kind)
        for load in ("closed", "poisson")
        for kind in ("short", "long")
    ]
    traces, warm = harness.scenario_traces(bench, _args(), 8, scenarios, vocab=2048)
    prompts = [tuple(item.prompt) for s in scenarios for item in traces[s]]
    prompts += [tuple(item.prompt) for item in warm]
    assert len(prompts) == len(set(prompts)), "a prompt repeats across scenarios"
    for s in scenarios:
        lo, hi = (16, 64) if s.prompts == "short" else (384, 640)
        assert all(lo <= len(item.prompt) <= hi for item in traces[s])
    again, _ = harness.scenario_traces(bench, _args(), 8, scenarios, vocab=2048)
    assert all(again[s] == traces[s] for s in scenarios), "traces are not reproducible"


class _Metrics(BaseHTTPRequestHandler):
    body = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        data = self.body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


VLLM_METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="base"} 8192.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="base"} 512.0
"""


def test_prefix_cache_hits_are_read_from_vllm_metrics(harness, metrics_server):
    url = f"http://127.0.0.1:{metrics_server.server_address[1]}"
    _Metrics.body = VLLM_METRICS
    assert harness.prefix_cache_hits(url) == (512.0, 8192.0)
    _Metrics.body = "# TYPE other_total counter\nother_total 3.0\n"
    assert harness.prefix_cache_hits(url) is None  # a server that does not say
    metrics_server.shutdown()
    metrics_server.server_close()
    assert harness.prefix_cache_hits(url) is None  # nothing listening


def test_skips_with_the_reason_where_the_peer_cannot_be_installed(harness, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert harness.main(["--venv", str(blocker / "venv"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIP: vLLM CPU peer unavailable: cannot make the venv folder"), out


def test_rounds_give_median_ratios_and_each_rounds(harness):
    """With --rounds, a row's ratios are the median of each round's ratio (not a ratio of
    medians), both servers' figures the medians, and the table lists every round's."""
    s = harness.Scenario(0, "poisson", "short")
    figures = [(100.0, 80.0, 2.0, 1.0), (90.0, 100.0, 3.0, 2.0), (120.0, 100.0, 2.0, 2.0)]
    runs = []
    for ours_tok, peer_tok, ours_itl, peer_itl in figures:
        one = dict.fromkeys(harness.METRICS, 1.0)
        runs.append(
            {
                (s, "symbiont"): {**one, "tok_s": ours_tok, "itl_p50": ours_itl},
                (s, "vllm"): {**one, "tok_s": peer_tok, "itl_p50": peer_itl,
                              "prefix_cache_hits": [0.0, 50.0]},
            }
        )  # fmt: skip
    row = harness.row_of(s, runs)
    assert row["ratios"]["tok_s"] == pytest.approx(1.2)  # of 1.25, 0.9, 1.2
    assert row["ratios"]["itl_p50"] == pytest.approx(1.5)  # of 2.0, 1.5, 1.0
    assert row["symbiont"]["tok_s"] == 100.0 and row["vllm"]["tok_s"] == 100.0
    assert row["vllm"]["prefix_cache_hits"] == [0.0, 150.0]
    table = harness.markdown_table([row])
    assert "| throughput per round | ITL p50 per round |" in table
    assert "| 1.25, 0.90, 1.20 | 2.00, 1.50, 1.00 |" in table
    assert "| 1.20x | 1.00x | 1.00x | 1.50x | 1.00x |" in table


def test_prefill_alone_skips_with_the_reason_too(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "prefill_alone_harness", REPO / "benchmarks" / "peers" / "prefill_alone.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert module.main(["--venv", str(blocker / "venv"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIP: vLLM CPU peer unavailable: cannot make the venv folder"), out

"""`k3verify serve --stack counted`: the engine's fast path over HTTP, batched, bit-equal to the reference.

The property is the definition: the same greedy (and seeded) requests, sent concurrently, get the
same tokens and the same logprobs from the engine stack as from the reference stack, while the
responses prove that their decodes ran batched in the fast step. The negative control serves a
fast-path mutant the same way and must part from the reference.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from k3verify import cli  # noqa: E402
from k3verify.commands import _check  # noqa: E402
from k3verify.kinds import kvv as kvv_kind  # noqa: E402
from k3verify.errors import UsageError  # noqa: E402
from k3verify.kinds.base import CheckSpec, Context  # noqa: E402
from k3verify.serving.backends.base import CompletionParams  # noqa: E402
from k3verify.serving.backends.engine_backend import EngineBackend  # noqa: E402
from k3verify.serving.lifecycle import ServerThread, build_embedded_app  # noqa: E402
from k3verify.serving.stack import counted_toggles, serve_stack  # noqa: E402
from optimized_stack import load_model  # noqa: E402
from optimized_stack.errors import K3Error  # noqa: E402
from optimized_stack.tokenizer import ByteTokenizer  # noqa: E402

# arrivals within this window start together, so their decodes share steps from the first token
WINDOW_S = 0.5
# four greedy requests of different lengths (a batch of 3 pads to 4 once the shortest ends) and one
# seeded sampled request: the engine must reproduce the reference's generator draws too
REQUESTS = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "logprobs": 1},
    {"prompt": "Once upon a time, in a land far away,", "max_tokens": 9, "temperature": 0, "logprobs": 1},
    {"prompt": "2 + 2 =", "max_tokens": 14, "temperature": 0, "logprobs": 1},
    {"prompt": "def main():", "max_tokens": 6, "temperature": 0, "logprobs": 1},
    {"prompt": "Hello", "max_tokens": 10, "temperature": 0.6, "top_p": 0.95, "seed": 7, "logprobs": 1},
]


def _ask_together(base_url: str, bodies: list[dict]) -> list[dict]:
    """POST every body at once (one thread each) to /completions; answers in body order."""
    answers: list[dict | None] = [None] * len(bodies)

    def ask(i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=120) as c:
            r = c.post("/completions", json=bodies[i])
            assert r.status_code == 200, r.text
            answers[i] = {**r.json(), "stack_header": r.headers.get("x-k3verify-stack")}

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers  # type: ignore[return-value]


def wait_idle(backend: EngineBackend, timeout_s: float = 10.0) -> bool:
    """True once the engine holds no unfinished request (every stream ended and was freed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with backend._cond:
            if not backend._inbox and not backend._aborts and not backend.engine.has_unfinished():
                return True
        time.sleep(0.01)
    return False


def _served(stack) -> ServerThread:
    return ServerThread(build_embedded_app("k3-mini", stack=stack, batch_window_s=WINDOW_S))


def _streams(answers: list[dict]) -> list[tuple]:
    """What must be equal bit for bit: per request the tokens and their logprobs (exact floats)."""
    return [(a["choices"][0]["logprobs"]["tokens"], a["choices"][0]["logprobs"]["token_logprobs"],
             a["choices"][0]["finish_reason"]) for a in answers]


@pytest.fixture(scope="module")
def reference_server():
    with _served(None) as server:
        yield server


@pytest.fixture(scope="module")
def reference_answers(reference_server) -> list[dict]:
    return _ask_together(reference_server.base_url, REQUESTS)


@pytest.fixture(scope="module")
def counted_server():
    stack = serve_stack("counted", [], "cpu")
    with _served(stack) as server:
        yield server


# ---- which stack -----------------------------------------------------------------------------------

def test_counted_stack_is_the_fast_path_that_runs_on_the_device():
    assert counted_toggles("cpu") == ("batched_decode", "prefill_sorted_experts", "prefill_batched_mixers")
    # every exact fast-path toggle of the device: the fused decode kernels too, judged by the same
    # suite's selftest (a toggle whose contract failed would fail that run, not pass unseen)
    assert set(counted_toggles("cuda")) == {"batched_decode", "cuda_graphs", "fused_kda_conv", "fused_moe_combine",
                                            "fused_situ", "prefill_sorted_experts", "prefill_batched_mixers"}
    stack = serve_stack("counted", [], "cpu")
    assert stack.label == "engine[batched_decode,prefill_batched_mixers,prefill_sorted_experts,projected_kv_cache]", "requires are applied and named"
    assert serve_stack(None, [], "cpu").label == "reference"


@pytest.mark.parametrize("stack,toggles,match", [
    (None, ["cuda_graphs"], r"toggle cuda_graphs runs on cuda only, not on cpu"),
    ("counted", ["batched_decode"], r"either the stack or the toggles"),
    ("reference", ["batched_decode"], r"the reference stack takes no toggles"),
    (None, ["spec_replay_ssm"], r"speculative decoding"),
    (None, ["batchd_decode"], r"did you mean 'batched_decode'"),
], ids=["cuda-only-on-cpu", "stack-and-toggles", "reference-with-toggles", "speculative", "typo"])
def test_stacks_that_cannot_be_served_are_refused_by_name(stack, toggles, match):
    with pytest.raises(K3Error, match=match):
        serve_stack(stack, toggles, "cpu")


def test_cli_cuda_only_toggle_on_cpu_is_one_line_exit_2(capsys):
    for argv in (["serve", "--toggle", "cuda_graphs", "--port", "0"],
                 ["kvv", "--self", "--toggle", "cuda_graphs"]):
        code = cli.main(argv)
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1 and "cuda_graphs runs on cuda only, not on cpu" in err, err


# ---- bitwise: engine-served tokens equal reference-served tokens -------------------------------------

def test_concurrent_requests_are_batched_and_equal_the_reference_bit_for_bit(counted_server, reference_answers):
    got = _ask_together(counted_server.base_url, REQUESTS)
    label = "engine[batched_decode,prefill_batched_mixers,prefill_sorted_experts,projected_kv_cache]"
    assert all(a["stack_header"] == label and a["system_fingerprint"] == f"k3verify-{label}" for a in got)
    assert all(a["stack_header"] == "reference" and a["k3verify"]["path_events"] == {} for a in reference_answers)
    fired = Counter()
    for a in got:
        fired.update(a["k3verify"]["path_events"])
    # evidence the counted stack ran as claimed: decodes in the batched step, several requests per
    # forward (the prefills shared one), and a padded batch (5 -> 8, or 3 -> 4 as requests end)
    assert fired["fast_decode_rows"] > 0 and fired["batched_forward"] > 0 and fired["fast_padded_rows"] > 0, fired
    assert fired["prefill_batched_mixers"] > 0, fired         # the shared prefill took the batched mixers
    ref, cand = _streams(reference_answers), _streams(got)
    parted = [i for i, (r, c) in enumerate(zip(ref, cand)) if r != c]
    assert not parted, f"requests {parted} differ from the reference: {[(ref[i], cand[i]) for i in parted]}"


def test_a_fast_path_mutant_served_the_same_way_parts_from_the_reference(reference_answers):
    # negative control: the conv window of request i stored from request i+1's input, only in a batch
    with _served(serve_stack(None, ["mut_fast_conv_wrong_row"], "cpu")) as server:
        got = _ask_together(server.base_url, REQUESTS)
    assert all(a["stack_header"] == "engine[mut_fast_conv_wrong_row]" for a in got)
    assert sum(a["k3verify"]["path_events"].get("fast_decode_rows", 0) for a in got) > 0
    assert _streams(got) != _streams(reference_answers), "the mutant's tokens equal the reference: the check is blind"


def test_grammar_constrained_and_streamed_answers_equal_the_reference(counted_server, reference_server):
    # a small schema, so the grammar completes in a dozen tokens (the engine request ends there)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
              "required": ["ok", "n"]}
    body = {"messages": [{"role": "user", "content": "give me json"}], "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    stream_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
                   "stream": True}
    answers = {}
    for name, server in (("ref", reference_server), ("eng", counted_server)):
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            whole = c.post("/chat/completions", json=body).json()
            with c.stream("POST", "/chat/completions", json=stream_body) as r:
                header = r.headers["x-k3verify-stack"]
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
        answers[name] = (whole, lines, header)
    (ref_whole, ref_lines, _), (whole, lines, header) = answers["ref"], answers["eng"]
    content = whole["choices"][0]["message"]["content"]
    assert content == ref_whole["choices"][0]["message"]["content"] and set(json.loads(content)) == {"ok", "n"}
    assert whole["choices"][0]["finish_reason"] == ref_whole["choices"][0]["finish_reason"] == "stop", \
        "the grammar completed: the engine request ended there, as the reference loop does"
    chunks, ref_chunks = [json.loads(ln[6:]) for ln in lines], [json.loads(ln[6:]) for ln in ref_lines]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    ref_text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in ref_chunks if ch["choices"])
    assert text == ref_text and header.startswith("engine[")
    final = [ch for ch in chunks if ch.get("k3verify")]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] is not None, \
        "the finishing chunk carries the request's path events"
    assert final[0]["k3verify"]["path_events"].get("fast_decode_rows", 0) >= 1


def test_stack_endpoint_reports_the_stack_and_its_events(counted_server):
    root = counted_server.base_url.removesuffix("/v1")
    info = httpx.get(f"{root}/stack", timeout=30).json()
    assert info["stack"] == "counted" and info["toggles"] == ["projected_kv_cache", "batched_decode",
                                                                  "prefill_sorted_experts", "prefill_batched_mixers"]
    assert info["device"] == "cpu" and info["fingerprint"] == "k3verify-engine[batched_decode,prefill_batched_mixers,prefill_sorted_experts,projected_kv_cache]"


def test_closing_a_stream_frees_its_engine_request():
    model, tok = load_model("k3-mini"), ByteTokenizer()
    backend = EngineBackend(model, tok, serve_stack("counted", [], "cpu"))
    try:
        stream = backend.generate(tok.encode("abc"), CompletionParams(max_tokens=50, temperature=0))
        first = [next(stream) for _ in range(2)]
        stream.close()
        assert len(first) == 2 and wait_idle(backend), "an abandoned request keeps its engine slot"
        assert backend.engine.results == {} and not backend.engine._requests, "finished requests are forgotten"
        again = list(backend.generate(tok.encode("abc"), CompletionParams(max_tokens=3, temperature=0)))
        assert [e.token_id for e in again[:2]] == [e.token_id for e in first]
    finally:
        backend.close()
    with pytest.raises(K3Error, match="closed"):
        backend.generate(tok.encode("abc"), CompletionParams(max_tokens=3))


# ---- KVV against the served stack ------------------------------------------------------------------

# batch.: the one check whose prompts arrive together, so the only one where prefill_batched_mixers
# (a counted toggle) fires; without it the served-stack row is not_exercised
KVV_ONLY = ["params.accept.temperature", "params.reject.n", "stream.reassembly", "batch."]


def test_kvv_against_the_counted_stack_passes_and_names_it():
    (unit,) = _check.plan(CheckSpec("kvv", options={"stack": "counted", "only": KVV_ONLY}))
    with Context(None, model_arg="k3-mini", placement={"device": "cpu"}) as ctx:
        rows = [r.to_dict() for r in kvv_kind.run(unit, ctx)]
    assert rows and all(r["status"] == "pass" for r in rows), [(r["check"], r["status"], r["reason"]) for r in rows]
    label = "engine[batched_decode,prefill_batched_mixers,prefill_sorted_experts,projected_kv_cache]"
    assert all(r["served_stack"] == label and list(r["responses_by_stack"]) == [label] for r in rows)
    (proof,) = [r for r in rows if r["check"] == "kvv/served-stack"]
    assert proof["stack_events"].get("fast_decode_rows", 0) > 0 and "fast_decode_rows=" in proof["reason"]
    assert proof["stack_events"].get("prefill_batched_mixers", 0) > 0


def test_served_stack_row_fails_on_another_stack_and_is_not_exercised_without_events():
    stack = serve_stack("counted", [], "cpu")
    label = stack.label
    wrong = kvv_kind.served_stack_result(stack, "reference", Counter({"reference": 5}), {}, "s")
    mixed = kvv_kind.served_stack_result(stack, label, Counter({label: 4, "reference": 1}), {"fast_decode_rows": 3}, "s")
    silent = kvv_kind.served_stack_result(stack, label, Counter({label: 5}), {"batched_forward": 2}, "s")
    ok = kvv_kind.served_stack_result(stack, label, Counter({label: 5}),
                                      {"fast_decode_rows": 3, "prefill_sorted_experts": 2, "prefill_batched_mixers": 1}, "s")
    # requests that never shared a prefill forward: the batched mixers did not run, so not proven
    alone = kvv_kind.served_stack_result(stack, label, Counter({label: 5}),
                                         {"fast_decode_rows": 3, "prefill_sorted_experts": 2}, "s")
    assert (wrong.status, mixed.status, silent.status, ok.status) == ("fail", "fail", "not_exercised", "pass")
    assert "batched_decode" in silent.reason
    assert alone.status == "not_exercised" and "prefill_batched_mixers" in alone.reason
    # cuda_graphs is proven by its replays, not by the batched step it shares with batched_decode
    graphs = serve_stack("counted", [], "cuda")
    eager = kvv_kind.served_stack_result(graphs, graphs.label, Counter({graphs.label: 5}), {"fast_decode_rows": 9}, "s")
    fused = {"fast_fused_conv_rows": 9, "fast_fused_combine_rows": 9, "fused_situ": 9, "prefill_sorted_experts": 9,
             "prefill_batched_mixers": 1}
    replayed = kvv_kind.served_stack_result(graphs, graphs.label, Counter({graphs.label: 5}),
                                            {"fast_decode_rows": 9, "graph_replay": 9, **fused}, "s")
    assert (eager.status, replayed.status) == ("not_exercised", "pass") and "graph_replay" in eager.reason
    # each fused kernel proves itself by its own event: replays without one are not enough
    no_combine = kvv_kind.served_stack_result(graphs, graphs.label, Counter({graphs.label: 5}),
                                              {"fast_decode_rows": 9, "graph_replay": 9,
                                               "fast_fused_conv_rows": 9, "fused_situ": 9,
                                               "prefill_sorted_experts": 9, "prefill_batched_mixers": 1}, "s")
    assert no_combine.status == "not_exercised" and "fused_moe_combine" in no_combine.reason
    assert "fused_situ (fused_situ)" not in no_combine.reason, "a kernel whose event fired was named silent"


@pytest.mark.parametrize("options,match", [
    ({"stack": "fast"}, r"must be one of reference, counted"),
    ({"toggles": ["batchd_decode"]}, r"did you mean 'batched_decode'"),
    ({"stack": "counted", "toggles": ["batched_decode"]}, r"either stack or toggles"),
    ({"stack": "counted", "base_url": "http://127.0.0.1:1/v1"}, r"a base_url or import_file does not apply"),
], ids=["unknown-stack", "unknown-toggle", "both", "with-base-url"])
def test_kvv_stack_options_are_checked(options, match):
    with pytest.raises(UsageError, match=match):
        _check.plan(CheckSpec("kvv", options=options))


def test_engine_abort_frees_running_waiting_and_future_requests():
    from optimized_stack.engine import Engine, EngineOptions, SamplingParams

    model = load_model("k3-mini")
    opts = EngineOptions(continuous_batching=True, projected_kv_cache=True, batched_decode=True, max_num_seqs=1,
                         device_cache_tokens=256)
    eng = Engine(model, opts)
    params = SamplingParams(max_new_tokens=8)
    running = eng.add_request([257, 65, 66, 67], params)
    waiting = eng.add_request([257, 70, 71], params)            # one slot: it waits behind `running`
    future = eng.add_request([257, 80], params, arrival_step=50)
    eng.step()
    assert eng.scheduler.running and eng.scheduler.waiting, "the scene: one running, one waiting, one not arrived"
    for rid in (running, waiting, future):
        eng.abort_request(rid)
        assert eng.forget(rid) is None or rid == running
    assert not eng.has_unfinished() and not eng._requests
    eng.abort_request("no-such-request")                        # unknown ids: nothing to do
    # the freed slot and blocks serve the next request as a fresh engine would
    again = eng.add_request([257, 65, 66, 67], params)
    fresh = Engine(model, opts)
    fresh.add_request([257, 65, 66, 67], params, request_id=again)
    assert eng.run()[again].tokens == fresh.run()[again].tokens
    with pytest.raises(K3Error, match="still running"):
        late = eng.add_request([257, 65], params)
        eng.step()
        eng.forget(late)

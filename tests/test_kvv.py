"""KVV contract checks against `k3verify serve` (must pass or skip with a reason) and against
non-compliant servers (the same checks must fail); vendor-range import of benchmark scores."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from k3verify.quality.evals.json_schema import schema_errors  # noqa: E402
from k3verify.quality.evals.kvv import run_kvv  # noqa: E402
from k3verify.quality.evals.kvv_ranges import import_kvv_results  # noqa: E402
from k3verify.serving.lifecycle import ServerThread, build_embedded_app  # noqa: E402
from optimized_stack.errors import K3Error  # noqa: E402

CONTRACT_PREFIXES = ["params.reject", "response_format.reject", "tool_choice.reject", "tools.reject",
                     "dynamic_tools.reject", "response_format.json_object", "response_format.json_schema",
                     "tool_choice.required", "tool_choice.named", "dynamic_tools.declared"]


def _by_status(result: dict) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {"pass": {}, "fail": {}, "skip": {}}
    for c in result["checks"]:
        out[c["status"]][c["name"]] = c["reason"]
    return out


def test_compliant_server_passes_every_check_or_skips_with_reason():
    with ServerThread(build_embedded_app("k3-mini")) as server:
        result = run_kvv(server.base_url, "k3-mini", max_tokens=4, structured_max_tokens=400)
    got = _by_status(result)
    assert not got["fail"], f"KVV checks failed on k3verify serve: {got['fail']}"
    assert set(got["skip"]) == {"prompt_tokens.expected_constants"}, \
        f"only the K3-tokenizer constants may be skipped, skipped: {got['skip']}"
    assert all("real K3 endpoint" in r for r in got["skip"].values()), "a skip must say what it needs"
    assert len(got["pass"]) >= 35 and result["passed"]


def test_server_without_contract_fails_the_contract_checks():
    """Negative control: the same server with validation and constraints off."""
    with ServerThread(build_embedded_app("k3-mini", enforce_contract=False)) as server:
        result = run_kvv(server.base_url, "k3-mini", max_tokens=1, structured_max_tokens=24,
                         only=CONTRACT_PREFIXES)
    got = _by_status(result)
    assert not got["pass"] and not got["skip"], f"these checks must fail without the contract: {got['pass']}"
    assert len(got["fail"]) == len(result["checks"]) >= 20 and not result["passed"]
    assert "should be rejected with 400, but it was accepted" in got["fail"]["params.reject.top_p=0.8"]


# ---- a deliberately lying endpoint: no model, answers fast ------------------------------------

def _liar_app(reject_all: bool) -> FastAPI:
    """Accepts everything (or refuses everything), miscounts tokens, streams a different answer,
    returns non-JSON for json formats and calls a tool when told 'none'."""
    app = FastAPI()
    calls = {"n": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "liar", "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return {"count": 10, "tokens": list(range(10))}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if reject_all:
            return JSONResponse(status_code=400, content={"error": {"message": "refused"}})
        calls["n"] += 1
        usage = {"prompt_tokens": 10 + calls["n"], "completion_tokens": 2, "total_tokens": 12 + calls["n"]}
        tool_calls = [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}] \
            if body.get("tool_choice") == "none" else None
        if body.get("stream"):
            def gen():
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "streamed"}}]}) + "\n\n"
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        message = {"role": "assistant", "content": "whole answer", "tool_calls": tool_calls}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage}

    return app


def test_lying_endpoint_fails_accounting_stream_and_format_checks():
    with ServerThread(_liar_app(reject_all=False)) as server:
        got = _by_status(run_kvv(server.base_url, "liar"))
    must_fail = ["stream.reassembly", "stream.usage_chunk",
                 "prompt_tokens.matches_tokenize.plain", "prompt_tokens.matches_tokenize.with_tools",
                 "prompt_tokens.consistent", "tool_choice.none", "response_format.json_object",
                 "response_format.json_schema", "tool_choice.required", "tool_choice.required.stream",
                 "params.reject.n=2", "dynamic_tools.reject.content_null"]
    missed = [n for n in must_fail if n not in got["fail"]]
    assert not missed, f"checks that did not catch the lying endpoint: {missed}"
    assert "differs from the whole answer" in got["fail"]["stream.reassembly"]
    assert "!= /tokenize count 10" in got["fail"]["prompt_tokens.matches_tokenize.plain"]


def test_refusing_endpoint_fails_acceptance_and_skips_stream_equality_with_reason():
    with ServerThread(_liar_app(reject_all=True)) as server:
        got = _by_status(run_kvv(server.base_url, "liar", only=["params.accept", "params.no_optional",
                                                               "stream.reassembly", "server.alive"]))
    assert set(got["fail"]) == {"params.accept.temperature=0.6", "params.accept.top_p=0.95",
                                "params.accept.presence_penalty=0", "params.accept.frequency_penalty=0",
                                "params.accept.n=1", "params.no_optional_params", "server.alive_after_bad_requests"}
    assert "temperature 0" in got["skip"]["stream.reassembly"]


def test_run_kvv_refuses_bad_input():
    with pytest.raises(K3Error, match="base_url must be an http"):
        run_kvv("localhost:1/v1", "m")
    with pytest.raises(K3Error, match="cannot reach http://127.0.0.1:9/v1"):
        run_kvv("http://127.0.0.1:9/v1", "m", timeout_s=2)
    with ServerThread(_liar_app(reject_all=True)) as server:
        with pytest.raises(K3Error, match="no KVV check starts with"):
            run_kvv(server.base_url, "liar", only=["parms"])


def test_schema_errors_finds_each_kind_of_break():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a"], "additionalProperties": False}
    assert schema_errors({"a": 3, "b": "x"}, schema) == []
    assert schema_errors({"b": "x"}, schema) == ["$: missing required 'a'"]
    assert schema_errors({"a": 1.5}, schema) == ["$.a: expected type integer, got float"]
    assert schema_errors({"a": 1, "b": "z"}, schema) == ["$.b: 'z' not in enum ['x', 'y']"]
    assert schema_errors({"a": 1, "c": 0}, schema) == ["$: unexpected property 'c'"]
    assert schema_errors({"a": True}, schema) == ["$.a: expected type integer, got bool"]


# ---- vendor ranges ------------------------------------------------------------------------------

def _write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_import_scores_in_range_pass_and_out_of_range_fail(tmp_path):
    p = _write(tmp_path, "kvv.json", json.dumps({"OCRBench": 0.89, "MMMU Pro Vision": 0.79,
                                                 "BEAM (1M)": {"score": 0.31}, "DeepSWE": 0.70}))
    result = import_kvv_results(p)
    status = {b["name"]: b["status"] for b in result["benchmarks"]}
    assert status == {"OCRBench": "pass", "MMMU-Pro Vision": "fail", "BEAM 1M": "pass", "DeepSWE": "fail"}
    assert not result["passed"]
    reasons = {b["name"]: b["reason"] for b in result["benchmarks"]}
    assert reasons["MMMU-Pro Vision"] == "0.79 below the vendor range [0.804, 0.82]"
    assert reasons["DeepSWE"] == "0.7 above the vendor range [0.658, 0.695]"


@pytest.mark.parametrize("edge", [0.878, 0.897], ids=["low-edge", "high-edge"])
def test_range_edges_are_inside(tmp_path, edge):
    result = import_kvv_results(_write(tmp_path, "r.json", json.dumps({"ocrbench": edge})))
    assert result["passed"] and result["benchmarks"][0]["status"] == "pass"


def test_import_wide_csv_like_the_kvv_readme_with_tbd(tmp_path):
    p = _write(tmp_path, "kvv.csv", "Provider,OCRBench,MMMU Pro Vision,BEAM (1M),DeepSWE\nAcme,0.892,0.817,TBD,0.69\n")
    result = import_kvv_results(p)
    assert result["summary"] == {"pass": 3, "fail": 0, "skip": 1} and result["passed"]


def test_import_long_csv_and_list_json(tmp_path):
    long_csv = _write(tmp_path, "long.csv", "benchmark,score\nocrbench,0.80\ndeepswe,0.67\n")
    assert import_kvv_results(long_csv)["summary"] == {"pass": 1, "fail": 1, "skip": 0}
    rows = _write(tmp_path, "rows.json", json.dumps([{"benchmark": "beam", "score": 0.30}]))
    assert import_kvv_results(rows)["passed"]


@pytest.mark.parametrize("name,text,match", [
    ("unknown.json", '{"OCRBenh": 0.89}', r"unknown KVV benchmark 'OCRBenh'; did you mean 'OCRBench'\?"),
    ("broken.json", '{"OCRBench": 0.89', r"expected JSON, parse error at line 1"),
    ("percent.json", '{"OCRBench": 89.0}', r"fraction in \[0, 1\], got 89.0 \(a percentage\? divide by 100\)"),
    ("word.json", '{"OCRBench": "high"}', r"expected a score in \[0, 1\], got 'high'"),
    ("twice.json", '{"OCRBench": 0.89, "ocr_bench": 0.88}', r"OCRBench appears twice"),
    ("empty.csv", "benchmark,score\n", r"expected a CSV header and at least one row"),
    ("two_rows.csv", "OCRBench,DeepSWE\n0.89,0.67\n0.88,0.66\n", r"exactly one data row, got 2"),
], ids=["unknown-name", "broken-json", "percentage", "not-a-number", "duplicate", "empty-csv", "wide-two-rows"])
def test_import_refuses_bad_files_in_one_line(tmp_path, name, text, match):
    with pytest.raises(K3Error, match=match) as err:
        import_kvv_results(_write(tmp_path, name, text))
    assert "\n" not in str(err.value)


def test_import_missing_file(tmp_path):
    with pytest.raises(K3Error, match=r"cannot read KVV results \(FileNotFoundError"):
        import_kvv_results(tmp_path / "absent.json")


def _load_dependent_app() -> FastAPI:
    """An endpoint whose greedy answer depends on how many requests it holds at once (a batch that
    changes a request's numerics): alone it says 'alone', under load 'busy N'."""
    import asyncio
    app = FastAPI()
    state = {"in_flight": 0}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.json()
        state["in_flight"] += 1
        await asyncio.sleep(0.3)                       # the others arrive meanwhile
        text = "alone" if state["in_flight"] == 1 else f"busy {state['in_flight']}"
        await asyncio.sleep(0.05)
        state["in_flight"] -= 1
        message = {"role": "assistant", "content": text}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    return app


def test_concurrent_answers_equal_the_answers_alone_and_a_load_dependent_endpoint_fails():
    """batch.concurrent_equals_alone passes on k3verify serve (it batches requests that arrive together,
    and its stack is batch-invariant) and fails on an endpoint whose answer follows its load."""
    with ServerThread(build_embedded_app("k3-mini")) as server:
        ok = _by_status(run_kvv(server.base_url, "k3-mini", max_tokens=4, only=["batch."]))
    assert set(ok["pass"]) == {"batch.concurrent_equals_alone"} and not ok["fail"], ok
    with ServerThread(_load_dependent_app()) as server:
        bad = _by_status(run_kvv(server.base_url, "m", max_tokens=4, only=["batch."]))
    assert "batch.concurrent_equals_alone" in bad["fail"], bad
    assert "answered 'busy" in bad["fail"]["batch.concurrent_equals_alone"]

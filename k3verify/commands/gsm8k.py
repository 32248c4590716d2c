"""`k3verify gsm8k`: lm-eval's gsm8k task on the embedded model or an endpoint, and the paired gate.

Without --toggle it measures the reference path (or --base-url through lm-eval's
local-completions model). With --toggle T the same questions and prompts (same
few-shot seed) are answered again with T applied, joined per question (doc_id and
lm-eval's prompt hash) and judged by the paired test at --margin (k3verify.quality.stats):
pass, fail, or inconclusive when n cannot resolve the margin; never a raw score
compare. Exit 0 pass, 1 fail or inconclusive (a gate that could not decide lets
nothing through; the last line says what n would), 2 bad input. --smoke marks the
results as a smoke test: an inconclusive smoke exits 0 and counts toward no toggle
verdict; a failing one still exits 1. Writes DIR/report.json (per filter accuracy,
per-question outcomes, the paired result with its MDE), .md, .html, junit.xml.
"""
from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from urllib.parse import urlparse

from rich.table import Table

from k3verify.commands import (add_json_flag, add_model_flag, command_line, console, emit_json, model_load_options,
                               served_model)
from k3verify.commands._costs import gsm8k_question_s
from k3verify.commands._progress import Item, RunProgress
from k3verify.errors import UsageError

NAME = "gsm8k"
HELP = "GSM8K through lm-eval (5-shot, strict and flexible); with --toggle the paired non-inferiority gate"


def add_arguments(parser) -> None:
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="first N test questions (default: all)")
    parser.add_argument("--dataset", choices=("gsm8k", "synth"), default="gsm8k",
                        help="gsm8k (Hugging Face openai/gsm8k, or --data-dir) or synth (seeded gsm8k-synth)")
    parser.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                        help="local train.jsonl + test.jsonl instead of the Hugging Face hub (offline)")
    parser.add_argument("--base-url", default=None, metavar="URL",
                        help="OpenAI-compatible endpoint (http://host:port/v1) run through lm-eval's local-completions")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="model name sent to --base-url (default: the first id from its /models)")
    parser.add_argument("--toggle", default=None, metavar="T", help="candidate toggle judged against the reference")
    parser.add_argument("--num-fewshot", type=int, default=5, metavar="K", help="few-shot examples (default 5)")
    parser.add_argument("--fewshot-seed", type=int, default=1234, metavar="S",
                        help="lm-eval's few-shot sampling seed, the same for both sides (default 1234)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="generation budget per question (default 256, lm-eval's)")
    parser.add_argument("--margin", type=float, default=0.01,
                        help="non-inferiority margin as a fraction (default 0.01 = 1 point)")
    parser.add_argument("--alpha", type=float, default=0.05, help="one-sided alpha (default 0.05)")
    parser.add_argument("--beta", type=float, default=0.2, help="1 - power for the stated MDE (default 0.2)")
    parser.add_argument("--min-accuracy", type=float, default=None, metavar="A",
                        help="without --toggle: fail a filter whose accuracy is below A (fraction)")
    parser.add_argument("--smoke", action="store_true",
                        help="a smoke test: the pipeline runs end to end; its pass or inconclusive counts toward "
                             "no verdict (a fail still fails)")
    parser.add_argument("--report-dir", type=Path, help="where to write the report (default reports/<run-id>)")
    add_model_flag(parser)
    add_json_flag(parser)


def completions_url(base_url: str) -> str:
    """http://host:port/v1 (or .../v1/completions) -> the completions URL lm-eval posts to."""
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageError(f"--base-url must be an http(s) URL like http://127.0.0.1:8000/v1, got {base_url!r}")
    url = base_url.rstrip("/")
    return url if url.endswith("/completions") else url + "/completions"


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_generate_fn(base_url: str, model_name: str | None, timeout_s: float = 600.0):
    """A generate_fn that forwards to lm-eval's own local-completions model (string prompts).

    Scoring and the task stay in run_gsm8k; only generation goes to the endpoint, through
    lm-eval's client (its payload: prompt, max_tokens, temperature 0, stop, seed).
    """
    url = completions_url(base_url)
    root = url[: -len("/completions")]
    # Probe first, with or without --model-name: lm-eval's client answers a closed port with
    # a traceback after its retries, not with a line that names the URL.
    model_name = served_model(root, model_name)
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        lm = LocalCompletionsAPI(base_url=url, model=model_name, tokenizer_backend=None,
                                 tokenized_requests=False, timeout=int(timeout_s), max_retries=1)
    except ModuleNotFoundError as e:
        raise UsageError(f"--base-url needs lm-eval's API extra ({e}); install lm-eval[api]==0.4.13") from None

    def generate(prompts: list[str], max_new_tokens: int, stop: list[str]) -> list[str]:
        gen = {"until": list(stop), "max_gen_toks": max_new_tokens, "do_sample": False, "temperature": 0.0}
        reqs = [Instance("generate_until", {}, (p, dict(gen)), i) for i, p in enumerate(prompts)]
        return lm.generate_until(reqs, disable_tqdm=True)

    return generate, model_name


def _validate(args) -> None:
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be a positive integer, got {args.limit}")
    if args.num_fewshot < 0:
        raise UsageError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0.0 <= args.margin < 1.0:
        raise UsageError(f"--margin is a fraction in [0, 1) (0.01 = 1 point), got {args.margin}")
    for flag, value in (("--alpha", args.alpha), ("--beta", args.beta)):
        if not 0.0 < value < 0.5:
            raise UsageError(f"{flag} must be in (0, 0.5), got {value}")
    if args.min_accuracy is not None and not 0.0 <= args.min_accuracy <= 1.0:
        raise UsageError(f"--min-accuracy is a fraction in [0, 1], got {args.min_accuracy}")
    if args.data_dir is not None and not args.data_dir.is_dir():
        raise UsageError(f"--data-dir must be a folder with train.jsonl and test.jsonl, got {args.data_dir}")
    if args.base_url is not None:
        completions_url(args.base_url)
        if args.toggle is not None:
            raise UsageError("--toggle applies to the embedded model; it cannot be combined with --base-url")
        if args.model is not None:
            raise UsageError("--model picks the embedded model; with --base-url use --model-name")
    if args.toggle is not None:
        from optimized_stack import toggles as registry
        registry.get(args.toggle)                 # unknown names: exit 2 before any work


validate = _validate          # `k3verify all` runs the same checks on a suite's gate arguments before any work


def _questions(args) -> int:
    """How many questions each side answers (for the progress line): --limit, else the test split."""
    from k3verify.quality.evals.gsm8k import SYNTH_TEST_N

    if args.dataset == "synth":
        size = SYNTH_TEST_N
    elif args.data_dir is not None and (args.data_dir / "test.jsonl").is_file():
        with open(args.data_dir / "test.jsonl", encoding="utf-8", errors="replace") as f:
            size = sum(1 for line in f if line.strip())
    else:
        size = 1319                       # openai/gsm8k's test split
    return min(args.limit, size) if args.limit else size


def summary_table(run) -> Table:
    table = Table(title=f"gsm8k {run.results[0]['scenario']}")
    for col in ("toggle", "filter", "reference", "candidate", "b", "c", "McNemar p", "bound", "MDE", "status"):
        table.add_column(col)
    for r in run.results:
        acc = r["accuracy"]
        if isinstance(acc, dict):
            cells = [f"{acc['acc_ref']:.4f}", f"{acc['acc_cand']:.4f}", str(acc["b"]), str(acc["c"]),
                     f"{acc['mcnemar_p']:.3g}", f"{acc['lower_bound']:+.4f}"]
        else:
            cells = [f"{acc[0]['value']:.4f}", "-", "-", "-", "-", "-"]
        colour = {"pass": "green", "inconclusive": "yellow"}.get(r["status"], "red")
        status = r["status"] + (" (smoke)" if r.get("role") == "smoke" else "")
        table.add_row(r["toggle"], r["filter"], *cells, f"{100 * r['mde']:.2f} pts", f"[{colour}]{status}[/]")
    return table


def verdict_line(verdict: str, results: list[dict]) -> str:
    """'verdict: inconclusive: n=2 cannot resolve ...': the run's verdict and, unless a pass, why."""
    why = [r["accuracy"]["verdict_reason"] for r in results
           if isinstance(r["accuracy"], dict) and r["status"] in ("fail", "inconclusive")]
    # "inconclusive: n=2 ..." under "verdict: inconclusive" would say the word twice
    why = [w[len(verdict) + 2:] if w.startswith(verdict + ": ") else w for w in why]
    smoke = any(r.get("role") == "smoke" for r in results)
    text = f"verdict: {verdict}" + (" (smoke test)" if smoke else "")
    return text + (f": {'; '.join(dict.fromkeys(why))}" if why else "")


def run(args) -> int:
    from k3verify.quality import gates as quality
    from k3verify.kinds import diff as verify
    from k3verify.quality.evals.gsm8k import greedy_generate_fn

    _validate(args)
    model = None
    if args.base_url is not None:
        ref_fn, model_name = endpoint_generate_fn(args.base_url, args.model_name)
        where = f"{model_name} @ {args.base_url}"
        if not is_loopback(args.base_url):
            print(f"note: sending GSM8K prompts to {args.base_url}", file=sys.stderr)
    else:
        from optimized_stack import load_model
        from optimized_stack.tokenizer import load_tokenizer
        model = load_model(args.model, **model_load_options(args))
        ref_fn = greedy_generate_fn(model, load_tokenizer(args.model))
        where = "embedded " + (args.model or "default model")
    per_question = gsm8k_question_s(args.max_new_tokens, args.num_fewshot)
    items = [Item("question", "gsm8k", per_question)] * (_questions(args) * (2 if args.toggle else 1))
    with RunProgress("gsm8k", items, log_prefix="  running ") as bar:
        ref_fn = bar.counting(ref_fn)     # one item per question answered, either side
        cand_fn = quality.toggled(ref_fn, [args.toggle]) if args.toggle else None
        gate = quality.gsm8k_gate(
            ref_fn, cand_fn, toggle=args.toggle, margin=args.margin, alpha=args.alpha, beta=args.beta,
            min_accuracy=args.min_accuracy, smoke=args.smoke, progress=bar.note,
            dataset=args.dataset, data_dir=args.data_dir, limit=args.limit, num_fewshot=args.num_fewshot,
            seed=args.fewshot_seed, max_new_tokens=args.max_new_tokens)
    if args.base_url is not None:  # the report must say which server answered, not only the command line
        for r in gate.results:
            r["endpoint"] = {"base_url": args.base_url, "model_name": model_name}
    run_id, default_dir = verify.default_report_dir("gsm8k")
    report, paths = verify.write(args.report_dir or default_dir, run_id, command_line(),
                                 model, gate.results, seeds={"fewshot_seed": args.fewshot_seed})
    con = console()
    con.print(summary_table(gate))
    ref = gate.details["reference"]
    con.print(f"{where}: {ref['n']} questions, {ref['seconds']:.1f} s reference "
              f"({ref['seconds_per_question']:.2f} s/question)"
              + (f", {gate.details['candidate']['seconds']:.1f} s candidate" if gate.details["candidate"] else ""))
    for r in gate.results:
        if isinstance(r["accuracy"], dict):
            con.print(f"{r['filter']}: {r['reason']}")
    verdict = report["summary"]["verdict"]
    con.print(f"report: {paths['md']}")
    con.print(verdict_line(verdict, gate.results), soft_wrap=True)
    if args.json:
        emit_json({"run_id": run_id, "verdict": verdict, "verdict_line": verdict_line(verdict, gate.results),
                   "report": str(paths["json"]),
                   "accuracy": gate.details["accuracy"], "paired": gate.details["paired"]})
    return 0 if verdict == "pass" else 1

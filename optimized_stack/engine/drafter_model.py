"""A trained draft model for speculative decoding: a small MLP head over the target's hidden state.

    drafter = ModelDrafter.for_target(model, opts, events)    # engine option drafter="model"
    with drafter.watching(model, [(request_id, start, end), ...]):
        model.forward_batch(...)           # the final-norm rows of the forward are kept per request
    drafts = drafter.propose_many([(request_id, tokens, k), ...])

The head (EAGLE-style, feature-level autoregression): the target's final-norm hidden state
h_t at position t and the target's embedding of the token at t+1 give the hidden state the
target will have at t+1; the target's own lm_head turns it into the draft for t+2. Draft j+1
feeds the head's predicted state and the embedding of draft j back in. Only the MLP is the
drafter's own (trained by distillation, KL to the target's logits: scripts/train_drafter.py);
embedding and lm_head are the target's, read at run time, so a drafter checkpoint is small
and is only valid for a target of its hidden size and vocabulary (checked on load).

Why this never touches exactness: drafts are only proposals, verification keeps what the
target's own argmax agrees with. The hidden state is read from the verification (or
prefill / decode) forward the engine runs anyway, through the model's `final_norm` probe: no
second forward. A request's draft needs the row that predicted its last token, position
len(tokens) - 2; the rows of rejected drafts sit past it and are never read.

Shape letters: B requests drafting, D hidden, V vocab, F the head's inner width.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import K3Error
from ..events import Events
from ..loading import GOLDEN_DIR

DRAFTERS_DIR = GOLDEN_DIR / "drafters"
CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "drafter.safetensors"
NORM_EPS = 1e-6


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int              # D: the target's hidden size
    vocab_size: int               # V: the target's vocabulary (its lm_head rows)
    inner_size: int               # F: the MLP's inner width
    target: str = ""              # the target it was distilled from (name), for the record

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "inner_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise K3Error(f"drafter config {name}: expected an integer >= 1, got {v!r}")

    @classmethod
    def from_file(cls, path: Path) -> "DrafterConfig":
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise K3Error(f"drafter config {path}: expected a JSON object, got an unreadable file ({exc})") from None
        if not isinstance(raw, dict):
            raise K3Error(f"drafter config {path}: expected a JSON object, got {type(raw).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        missing = sorted(k for k in ("hidden_size", "vocab_size", "inner_size") if k not in raw)
        if unknown or missing:
            raise K3Error(f"drafter config {path}: unknown keys {unknown}, missing keys {missing}")
        return cls(**raw)


class DraftHead(nn.Module):
    """(h_t [B, D], e_{t+1} [B, D]) -> the predicted final-norm hidden state at t+1 [B, D].

    Both inputs are RMS-normalised first (the target's hidden state and its embeddings live at
    different scales); the MLP's output is added to h_t, as the next state is mostly the last one."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc_in = nn.Linear(2 * cfg.hidden_size, cfg.inner_size)
        self.fc_out = nn.Linear(cfg.inner_size, cfg.hidden_size)
        nn.init.zeros_(self.fc_out.weight)        # start as "the next state is this state"
        nn.init.zeros_(self.fc_out.bias)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = torch.cat([_rms(h), _rms(e)], -1)                           # [B, 2D]
        return h + self.fc_out(F.silu(self.fc_in(x)))                   # [B, D]


def _rms(x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(x.dtype)


def rollout(head: DraftHead, embed: torch.Tensor, lm_head: torch.Tensor, h: torch.Tensor,
            last: torch.Tensor, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """k drafts from h [B, D] (the state that predicted `last`) and last [B] token ids ->
    (drafts [B, k], the draft logits of each step, k x [B, V]). The head's own argmax is fed back."""
    drafts, logits = [], []
    tok = last
    for _ in range(k):
        h = head(h, F.embedding(tok, embed))                            # [B, D]
        row = F.linear(h, lm_head)                                      # [B, V]
        tok = row.argmax(-1)
        drafts.append(tok)
        logits.append(row)
    return torch.stack(drafts, 1), logits


# ---- checkpoints ------------------------------------------------------------------------

def save_drafter(head: DraftHead, directory: Path) -> None:
    """config + safetensors, each written atomically (a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in head.state_dict().items()}
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, directory / WEIGHTS_FILE)
    tmp = directory / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(head.cfg), indent=2) + "\n")
    os.replace(tmp, directory / CONFIG_FILE)


def load_drafter(directory: str | Path) -> DraftHead:
    """A drafter checkpoint directory -> its head (CPU, fp32, eval). One-line K3Error otherwise."""
    path = Path(directory)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise K3Error(f"drafter checkpoint {path}: expected {CONFIG_FILE} and {WEIGHTS_FILE} in a directory")
    cfg = DrafterConfig.from_file(path / CONFIG_FILE)
    head = DraftHead(cfg)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise K3Error(f"drafter checkpoint {path / WEIGHTS_FILE}: not a readable safetensors file ({exc})") from None
    want = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if want != got:
        bad = sorted(set(want) ^ set(got)) or sorted(k for k in want if want[k] != got[k])
        raise K3Error(f"drafter checkpoint {path}: tensors do not fit its config at {bad[0]!r} "
                      f"(expected {want.get(bad[0])}, got {got.get(bad[0])})")
    if not all(torch.isfinite(t).all() for t in tensors.values()):
        raise K3Error(f"drafter checkpoint {path}: holds NaN or inf")
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    return head.eval()


def default_drafter_dir(model) -> Path:
    """golden/drafters/<the target's name>: the directory name of a checkpoint, or the preset name."""
    source = str(getattr(model, "source", "") or "")
    name = source.split(":")[1] if source.startswith("preset:") else Path(source).name
    if not name:
        raise K3Error("engine option drafter='model': the target has no name to find its drafter by; "
                      "pass drafter_checkpoint")
    return DRAFTERS_DIR / name


def check_fits(cfg: DrafterConfig, model, where: Path) -> None:
    """The head was trained on the target's hidden states, embedding and lm_head: same D and V."""
    tc = model.config
    if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise K3Error(f"drafter checkpoint {where}: made for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, "
                      f"the target has hidden {tc.hidden_size} / vocab {tc.vocab_size}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- the engine's drafter ---------------------------------------------------------------

class ModelDrafter:
    """Drafts for the engine from the final-norm rows of the forwards it already runs.

    `lag` reads the hidden state that many positions too early: 0 in service; tests set 1 as
    the negative control of the acceptance metric (a wrong-position drafter stays exact, only
    its acceptance drops)."""

    def __init__(self, model, head: DraftHead, events: Events | None = None, *,
                 faults: frozenset[str] = frozenset(), lag: int = 0):
        self.model = model
        w = model.lm_head.weight
        self.head = head.to(device=w.device, dtype=w.dtype)
        self.events = events if events is not None else Events()
        self.in_place = "mut_spec_model_capture_in_place" in faults
        self.lag = lag
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}   # request -> (first position, rows [n, D])

    @classmethod
    def for_target(cls, model, checkpoint: str | None, events: Events | None = None, *,
                   faults: frozenset[str] = frozenset()) -> "ModelDrafter":
        where = Path(checkpoint) if checkpoint else default_drafter_dir(model)
        if not where.is_dir():
            have = sorted(p.name for p in DRAFTERS_DIR.iterdir() if p.is_dir()) if DRAFTERS_DIR.is_dir() else []
            raise K3Error(f"engine option drafter='model': no drafter checkpoint at {where} (shipped: "
                          f"{', '.join(have) or 'none'}); train one with scripts/train_drafter.py")
        cfg = DrafterConfig.from_file(where / CONFIG_FILE) if (where / CONFIG_FILE).is_file() else None
        if cfg is not None:
            check_fits(cfg, model, where)       # before reading weights: the cheap, common mistake
        head = load_drafter(where)
        return cls(model, head, events, faults=faults)

    @contextlib.contextmanager
    def watching(self, segments: list[tuple[str, int, int]], keep: int, wanted: set[str]) -> Iterator[None]:
        """During one forward_batch over `segments` (request id, first position, end position) in
        order: keep the last `keep` final-norm rows of each request in `wanted`, joined to the rows
        its earlier forwards left (a draft starts from the row at len(tokens) - 2; rows of rejected
        drafts sit past it and are overwritten by the next forward, which starts at the first of
        them). With nothing wanted no probe is attached: the forward runs untouched."""
        if not wanted:
            yield
            return
        seen: list[torch.Tensor] = []

        def probe(layer: int, name: str, t: torch.Tensor) -> None:
            if name != "final_norm":
                return
            if self.in_place:
                # the seeded fault: the head's input scaling applied to the captured rows in
                # place, i.e. to the very tensor the target's lm_head reads next
                t.mul_(torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + NORM_EPS).to(t.dtype))
            seen.append(t)
        with self.model.probe(probe):
            yield
        if not seen:
            return
        rows, offset = seen[-1], 0                                        # [T, D] over all segments
        for rid, a, b in segments:
            mine = rows[offset:offset + b - a]                            # positions a .. b-1
            offset += b - a
            if rid not in wanted:
                continue
            prev = self._rows.get(rid)
            if prev is not None and prev[0] <= a <= prev[0] + prev[1].shape[0]:
                # positions before a are the earlier forwards' (anything from a on is recomputed)
                first, mine = prev[0], torch.cat([prev[1][:a - prev[0]], mine])
            else:
                first = a
            cut = max(0, mine.shape[0] - keep)
            self._rows[rid] = (first + cut, mine[cut:].detach().clone())

    def forget_except(self, live: set[str]) -> None:
        for rid in [r for r in self._rows if r not in live]:
            del self._rows[rid]

    @torch.no_grad()
    def propose_many(self, items: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """(request id, tokens, k) -> up to k drafts each, all requests in one batch. A request
        whose predicting row was not kept (its last token came from elsewhere) gets none."""
        out: list[list[int]] = [[] for _ in items]
        ready, hs, lasts = [], [], []
        for i, (rid, tokens, k) in enumerate(items):
            got = self._rows.get(rid)
            pos = len(tokens) - 2 - self.lag                   # the row that predicted tokens[-1]
            if k <= 0 or got is None or not got[0] <= pos < got[0] + got[1].shape[0]:
                continue
            ready.append(i)
            hs.append(got[1][pos - got[0]])
            lasts.append(tokens[-1])
        if not ready:
            return out
        k_max = max(items[i][2] for i in ready)
        w = self.model.lm_head.weight
        h = torch.stack(hs)                                                # [B, D]
        last = torch.tensor(lasts, dtype=torch.long, device=w.device)      # [B]
        drafts, _ = rollout(self.head, self.model.model.embed_tokens.weight, w, h, last, k_max)
        drafts = drafts.tolist()
        for j, i in enumerate(ready):
            out[i] = drafts[j][:items[i][2]]
        self.events.fire("spec_model_drafts")
        return out

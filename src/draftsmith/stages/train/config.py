"""Training configuration: plain data, no torch import (the CLI builds its parser from it quickly)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.core.block_facts import BLOCK_SIZE_MAX, BLOCK_SIZE_MIN
from draftsmith.core.errors import DraftsmithError


class TrainError(DraftsmithError, ValueError):
    """A run that cannot start or continue: bad config, mismatched store or resume directory, NaN loss."""


def option(default, help: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, choices: tuple[str, ...] | None = None, why: str = ""):
    """A TrainConfig field with everything the CLI and validation need: its help text and its bounds.

    ``lo``/``hi``: inclusive bounds (exclusive with ``lo_open``/``hi_open``); ``choices``: allowed strings;
    ``why``: the reason for a bound, added to the error (and to the help)."""
    meta = {"help": help + (f" ({why})" if why else ""), "lo": lo, "hi": hi, "lo_open": lo_open,
            "hi_open": hi_open, "choices": choices, "why": why}
    return field(default=default, metadata=meta)


_TTT_WHY = ("acceptance decays geometrically with the draft position, so past a few dozen nothing is accepted "
            "while each step costs a drafter forward and backward")
_ACCUM_WHY = "an optimizer step over more micro-batches is a larger --batch-tokens"
_COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KINDS = ("eagle3", "dflash", "dspark")
MAX_MARKOV_RANK = 4096
BLOCK_KINDS = ("dflash", "dspark")
# The block kinds' loss defaults: DeepSpec's recipe (its DFlash baseline: CE only).
# The model's own fields (block size, layers, Markov head) default in model/block_drafter.py.
BLOCK_DEFAULTS = {
    "dflash": {"num_anchors": 512, "loss_decay_gamma": 4.0, "ce_weight": 1.0, "l1_weight": 0.0,
               "confidence_weight": 0.0},
    "dspark": {"num_anchors": 512, "loss_decay_gamma": 4.0, "ce_weight": 0.1, "l1_weight": 0.9,
               "confidence_weight": 1.0},
}
BLOCK_FIELDS = ("block_size", "draft_layers", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                "num_anchors", "loss_decay_gamma", "ce_weight", "l1_weight", "confidence_weight")
DSPARK_ONLY = ("markov_rank", "markov_head_type", "confidence_weight")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class TrainConfig:
    """Every training setting: the one place each ``train`` flag is defined, described and bounded."""

    target: str = option("smollm2", "model dir, .gguf file or 'smollm2'; offline mode reads only its embeddings "
                                    "and lm_head")
    store: str | None = option(None, "offline data: a feature store written by `draftsmith capture`")
    conversations: str | None = option(None, "online data: conversations JSONL; the target runs inside the loop")
    out: str = option("runs/drafter", "run directory: checkpoints, logs, plots, best/ and final/")
    vocab: str | None = option(None, "d2t/t2d file (default: the store's vocab.safetensors)")
    draft_vocab_size: int = option(32000, "draft vocabulary size when the vocabulary is built on the fly "
                                          "(online mode)", lo=1)
    init_drafter: str | None = option(None, "start from this drafter directory instead of random weights")
    init_head: bool = option(False, "a fresh drafter's lm_head and norm start as the target's head rows and final "
                                     "norm")
    # --- EAGLE-3.1 norms of a new drafter (config names as speculators and vLLM write them; an init_drafter
    # keeps its own). All off: an EAGLE-3 drafter. speculators turns norm_before_fc and norm_output on by default.
    norm_before_fc: bool = option(False, "EAGLE-3.1: one RMSNorm over the concatenated aux hidden states before fc "
                                         "(input_norm)")
    fc_norm: bool = option(False, "EAGLE-3.1: one RMSNorm per aux hidden state before fc (fc_norm.{i}); excludes "
                                  "norm_before_fc")
    norm_output: bool = option(False, "EAGLE-3.1: later TTT / draft steps are fed the drafter's normed output "
                                      "state, not the raw one")
    norm_before_residual: bool = option(False, "the residual around the drafter's attention is hidden_norm(g), not g "
                                               "(speculators' default)")
    ttt_steps: int = option(7, "eagle3: training-time-test steps: draft positions trained per sample, each fed the "
                               "drafter's own previous output", lo=1, hi=64, why=_TTT_WHY)
    step_decay: float = option(0.8, "eagle3: loss weight of TTT step k is step_decay**k", lo=0, hi=1, lo_open=True)
    teacher_temperature: float = option(1.0, "temperature of the target's soft labels (0: one-hot labels; 1 "
                                             "measured best)", lo=0)
    train_on: str = option("answers", "positions that train: answers (assistant tokens, what decoding drafts) or "
                                      "all (prompts too); evaluation always scores answers",
                           choices=("answers", "all"))
    epochs: int = option(1, "passes over the training data when --max-steps is 0", lo=1)
    train_samples: int = option(0, "0: every training sample; N: the first N by id hash (data-scaling curves)",
                                lo=0)
    max_steps: int = option(0, "optimizer steps; 0: as many as --epochs give", lo=0)
    max_minutes: float = option(0.0, "0: no time bound; else the step count (at most --max-steps/--epochs') is "
                                     "planned after the warm-up, and again at each evaluation, to end within this "
                                     "many minutes of the run's start; the checkpoint keeps the plan", lo=0)
    batch_tokens: int = option(2048, "tokens per micro-batch (length-bucketed, right-padded)", lo=2)
    grad_accum: int = option(1, "micro-batches per optimizer step", lo=1, hi=1024, why=_ACCUM_WHY)
    lr: float = option(1e-4, "peak learning rate (AdamW; with --optimizer muon, of the parameters AdamW keeps)",
                       lo=0, lo_open=True)
    optimizer: str = option("adamw", "adamw, or muon: Muon (torch.optim.Muon) for the hidden 2-D weight matrices, "
                                     "AdamW for the rest (embeddings, lm_head, Markov head, norms, biases), the "
                                     "split speculators uses", choices=("adamw", "muon"))
    muon_lr: float | None = option(None, "peak learning rate of the Muon matrices (default 10 * --lr, as "
                                         "speculators; the update is scaled to AdamW's RMS)", lo=0, lo_open=True)
    muon_weight_decay: float | None = option(None, "Muon's decoupled weight decay (default 0.1, speculators')",
                                             lo=0)
    loss: str = option("kl", "eagle3: the loss of each TTT step against the target's distribution p over the draft "
                             "vocabulary: kl (soft cross-entropy, KL's gradient), tv (total variation 1 - sum "
                             "min(p, q)), nla (-log sum min(p, q)) or lk (LK-lambda: lambda * KL + (1 - lambda) * TV, "
                             "lambda = exp(-3 * sum min(p, q)) held constant); sum min(p, q) is the acceptance "
                             "probability", choices=("kl", "tv", "nla", "lk"))
    warmup_steps: int = option(20, "linear learning-rate warm-up steps", lo=0)
    min_lr_ratio: float = option(0.1, "the cosine schedule ends at lr * min_lr_ratio", lo=0, hi=1)
    weight_decay: float = option(0.0, "AdamW weight decay", lo=0)
    grad_clip: float = option(0.5, "gradient norm clip", lo=0, lo_open=True)
    eval_fraction: float = option(0.05, "share of samples held out for evaluation, by a hash of the id (0: none)",
                                  lo=0, hi=1, hi_open=True)
    eval_every: int = option(50, "evaluate every N optimizer steps", lo=1)
    save_every: int = option(50, "write a checkpoint every N optimizer steps", lo=1)
    log_every: int = option(10, "log every N optimizer steps", lo=1)
    max_length: int = option(2048, "tokens per sample; longer samples are cut", lo=2)
    seed: int = option(0, "seed of weights, batch order and the held-out split")
    device: str = option("auto", "auto (CUDA when this torch sees a GPU, else cpu), cpu, cuda, cuda:N; under "
                                 "torchrun with CUDA each rank takes its own GPU")
    dtype: str = option("auto", "compute dtype of the target in online mode (auto: float32 on CPU, bfloat16 on "
                                "CUDA); the drafter keeps float32 master weights", choices=_COMPUTE_DTYPES)
    autocast: str = option("auto", "bf16 matmuls over fp32 master weights: auto (on for CUDA and for CPUs with "
                                   "AMX, where it pays), bf16 or off", choices=("auto", "bf16", "off"))
    force: bool = option(False, "train on a store made for another target anyway")
    resume: bool = option(False, "continue the run in --out from its last checkpoint")
    stop_at_step: int = option(0, "stop (with a checkpoint) after this step; 0: never (interruptions, tests)",
                               lo=0)
    plot: bool = option(True, "write loss and acceptance plots")
    progress: bool = option(True, "show a progress bar")
    # --- the drafter kind (docs: block drafters). The block kinds' options default to None, "the kind's default"
    # (BLOCK_DEFAULTS), so that a block option given to an eagle3 run is refused instead of ignored.
    kind: str = option("eagle3", "drafter kind: eagle3 (one token per drafter pass, trained with TTT), dflash or "
                                 "dspark (a block of tokens per pass, trained on random anchors)", choices=KINDS)
    block_size: int | None = option(None, "dflash/dspark: query slots per block: the anchor (the last known token) "
                                           "and block_size - 1 mask tokens; dflash drafts block_size - 1 tokens, "
                                           "dspark block_size (default 8 dflash, 7 dspark)", lo=BLOCK_SIZE_MIN,
                                    hi=BLOCK_SIZE_MAX,
                                    why="every slot costs drafter compute in every layer and acceptance decays "
                                        "with the slot")
    draft_layers: int | None = option(None, "dflash/dspark: decoder layers of a new drafter (default 2)", lo=1,
                                      hi=64)
    target_layer_ids: str | None = option(None, "dflash/dspark: comma-separated target layers the drafter reads, "
                                                "numbered as DFlash and DeepSpec do: id i = the output of layer i "
                                                "(capture's --aux-layers i+1; -1: the embeddings); default: the "
                                                "store's layers offline, 5 spread over layers 1..N-3 online")
    mask_token_id: int | None = option(None, "dflash/dspark: the token id that fills a block's draft slots "
                                             "(default: the model's choice)", lo=0)
    markov_rank: int | None = option(None, "dspark: rank of the Markov head (previous token -> logit bias; "
                                           "default 256; 0: none)", lo=0, hi=MAX_MARKOV_RANK,
                                     why="a low-rank bias: two vocabulary x rank tables, and DeepSpec's rank is 256")
    markov_head_type: str | None = option(None, "dspark: vanilla (bias from the previous token; what vLLM and "
                                                "llama.cpp read), gated or rnn (DeepSpec's; default vanilla)",
                                          choices=("vanilla", "gated", "rnn"))
    num_anchors: int | None = option(None, "dflash/dspark: blocks trained per sample, at random answer positions "
                                           "(default 512; fewer where a sample has fewer)", lo=1)
    loss_decay_gamma: float | None = option(None, "dflash/dspark: the loss weight of the k-th drafted slot is "
                                                  "exp(-k / gamma) (default 4)", lo=0, lo_open=True)
    ce_weight: float | None = option(None, "dflash/dspark: weight of the cross-entropy to the target's choice "
                                           "(default 1 dflash, 0.1 dspark)", lo=0)
    l1_weight: float | None = option(None, "dflash/dspark: weight of the L1 distance between the drafter's and the "
                                           "target's probabilities, 2x their total variation (default 0 dflash, "
                                           "0.9 dspark)", lo=0)
    confidence_weight: float | None = option(None, "dspark: weight of the confidence head's loss (BCE to each "
                                                   "slot's acceptance probability; default 1; 0: no head)", lo=0)

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    def validate(self) -> None:
        """Every field against its type and bounds, then the fields together: one line per bad value."""
        for name, f in self.fields().items():
            _check_field(name, f, getattr(self, name))
        if (self.store is None) == (self.conversations is None):
            raise TrainError("give exactly one data source: store (offline) or conversations (online)")
        _check_norms(self)
        _check_kind(self)
        muon = [k for k in ("muon_lr", "muon_weight_decay") if getattr(self, k) is not None]
        if muon and self.optimizer != "muon":
            raise TrainError(f"{', '.join(_flag(k) for k in muon)}: Muon option(s); add --optimizer muon")

    def block_option(self, name: str):
        """A block kind's option: its value, else the kind's default."""
        value = getattr(self, name)
        return BLOCK_DEFAULTS[self.kind].get(name) if value is None else value

    def layer_ids(self) -> tuple[int, ...] | None:
        """``target_layer_ids`` as ints (None: not given)."""
        return None if self.target_layer_ids is None else parse_layer_ids(self.target_layer_ids)


def _flag(name: str) -> str:
    """A field as both its flag and its config-file key, where they differ: ``--ttt-steps (ttt_steps)``."""
    flag = f"--{name.replace('_', '-')}"
    return flag if "_" not in name else f"{flag} ({name})"


def _check_field(name: str, f: dataclasses.Field, value) -> None:
    kind = str(f.type).split(" |")[0]
    optional = "None" in str(f.type)
    if value is None:
        if optional:
            return
        raise TrainError(f"{_flag(name)} needs a value")
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}.get(kind, True)
    if not ok:
        raise TrainError(f"{_flag(name)} takes a{'n' if kind == 'int' else ''} {kind}, not {value!r}")
    meta = f.metadata
    if kind == "float" and not math.isfinite(value):
        raise TrainError(f"{_flag(name)} must be a finite number, not {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        *first, last = meta["choices"]
        raise TrainError(f"{_flag(name)} must be {', '.join(first)} or {last}, not {value!r}")
    if name == "device" and not _DEVICE.match(value.strip().lower()):
        raise TrainError(f"--device must be auto, cpu, cuda or cuda:N, not {value!r}")
    lo, hi = meta.get("lo"), meta.get("hi")
    low = lo is not None and (value <= lo if meta["lo_open"] else value < lo)
    high = hi is not None and (value >= hi if meta["hi_open"] else value > hi)
    if low or high:
        left = "" if lo is None else f"{'>' if meta['lo_open'] else '>='} {lo:g}"
        right = "" if hi is None else f"{'<' if meta['hi_open'] else '<='} {hi:g}"
        why = f": {meta['why']}" if meta.get("why") else ""
        raise TrainError(f"{_flag(name)} must be {' and '.join(x for x in (left, right) if x)}, not {value!r}{why}")


# Fields that may change between a run and its resumption (they do not change what is computed).
# max_minutes: a plan, once made, is in the checkpoint; a resume with another budget keeps it.
_RESUMABLE = {"resume", "stop_at_step", "progress", "plot", "log_every", "force", "device", "max_minutes"}


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """A config file (TOML or YAML) with command-line overrides; unknown keys name the closest valid one."""
    values: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"{path}: no such config file")
        values = _read_config_file(p)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if isinstance(values.get("target_layer_ids"), list):  # a TOML/YAML list of ids
        values["target_layer_ids"] = ",".join(str(x) for x in values["target_layer_ids"])
    known = TrainConfig.fields()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TrainError(f"unknown config key {key!r}{hint}")
        kind = str(known[key].type).split(" |")[0]
        if kind in ("int", "float") and isinstance(values[key], str):  # "3", as the other commands' recipes take
            with contextlib.suppress(ValueError):  # validate() names a value that does not parse
                values[key] = int(values[key]) if kind == "int" else float(values[key])
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


NORM_FIELDS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")


def _check_norms(cfg: TrainConfig) -> None:
    if cfg.norm_before_fc and cfg.fc_norm:
        raise TrainError("norm_before_fc and fc_norm exclude each other (one norm over the concatenated aux states, "
                         "or one per state); choose one")
    on = [k for k in NORM_FIELDS if getattr(cfg, k)]
    if cfg.init_drafter and on:
        raise TrainError(f"{', '.join(on)}: an init_drafter keeps the norms its config.json names; "
                         "these options shape a new drafter")


def parse_layer_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        ids = ()
    if not ids or any(i < -1 for i in ids):
        raise TrainError(f"--target-layer-ids (target_layer_ids) takes comma-separated layer ids >= -1, not {text!r}")
    if len(set(ids)) != len(ids):
        raise TrainError(f"--target-layer-ids (target_layer_ids) {text!r} names a layer twice")
    return ids


def _check_kind(cfg: TrainConfig) -> None:
    """Options of another kind are refused, not ignored: a flag that does nothing is a silent mistake."""
    given = [k for k in BLOCK_FIELDS if getattr(cfg, k) is not None]
    if cfg.kind == "eagle3" and given:
        raise TrainError(f"{', '.join(_flag(k) for k in given)}: dflash/dspark option(s); this run trains "
                         "--kind eagle3 (add --kind dflash or --kind dspark)")
    if cfg.kind == "dflash":
        dspark = [k for k in DSPARK_ONLY if getattr(cfg, k) not in (None, 0, 0.0)]
        if dspark:
            raise TrainError(f"{', '.join(_flag(k) for k in dspark)}: dspark option(s) (a Markov or confidence head); "
                             "this run trains --kind dflash")
    if cfg.kind in BLOCK_KINDS:
        if cfg.loss != "kl":
            raise TrainError(f"--loss {cfg.loss}: an eagle3 option; a {cfg.kind} drafter trains on --ce-weight and "
                             "--l1-weight (L1 is twice the total variation)")
        cfg.layer_ids()
        norms = [k for k in NORM_FIELDS if getattr(cfg, k)]
        if norms:
            raise TrainError(f"{', '.join(_flag(k) for k in norms)}: EAGLE-3.1 option(s); this run trains --kind "
                             f"{cfg.kind}")
        if cfg.block_option("ce_weight") + cfg.block_option("l1_weight") <= 0:
            raise TrainError("--ce-weight and --l1-weight are both 0: nothing would train the drafter's tokens")


def _read_config_file(p: Path) -> dict:
    """A TOML or YAML (safe_load: tags that build objects are refused) file's table, its [train] section if any."""
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = tomllib.loads(text)
    except Exception as e:  # UnicodeDecodeError, TOMLDecodeError, every yaml.YAMLError: the file, on one line
        raise TrainError(f"{p}: not a readable config file ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                         ) from e
    values = values.get("train", values) if isinstance(values, dict) else values
    if not isinstance(values, dict):
        raise TrainError(f"{p}: a config file holds a table of fields, not a {type(values).__name__}")
    return values


# Fields added after runs existed: hashed only off their default, so those runs still resume.
_ADDED_LATER = {"teacher_temperature": 1.0, "train_on": "answers", "norm_before_fc": False, "fc_norm": False,
                "norm_output": False, "norm_before_residual": False, "kind": "eagle3", "optimizer": "adamw",
                "muon_lr": None, "muon_weight_decay": None, "loss": "kl",
                **{k: None for k in BLOCK_FIELDS}}


def config_hash(cfg: TrainConfig) -> str:
    d = {k: v for k, v in dataclasses.asdict(cfg).items()
         if k not in _RESUMABLE and _ADDED_LATER.get(k, object()) != v}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

"""Recipes (``--config RECIPE.toml``): the mechanism, the shipped recipes' keys and commands, and each shipped
recipe run end to end on CPU with a tiny model of its architecture (torchrun training on 2 gloo processes).

The end-to-end runs take everything from the recipe except the target (a tiny model instead of /models/...),
the devices (cpu), sizes (tokens, steps) and generate's backend (the in-process one instead of a vLLM server).
They run in a temporary directory, so the recipe's own relative paths wire the stages together. The MoE recipe
captures with ``--backend hf`` here: its ``--backend vllm`` route needs vLLM's environment (.venv-vllm) and a
GPU-sized engine; tests/test_vllm_capture.py covers that route on tiny targets.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from draftsmith.app.cli import build_parser, main, parse_args
from draftsmith.app.recipe import recipe_keys

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def _parse(argv: list[str]):
    return parse_args(argv)


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return str(path)


# --- the mechanism ------------------------------------------------------------------------------------------
def test_a_section_gives_defaults_and_flags_given_win(tmp_path):
    r = _write(tmp_path, '[capture]\nconversations = "c.jsonl"\nout = "store"\nmax-length = 4096\n'
                         'aux_layers = [2, 4, 5]\nno_progress = true\nbackend = "vllm"\ntensor_parallel_size = 8\n')
    args = _parse(["capture", "--config", r, "--max-length", "256", "-tp", "2"])
    assert (args.conversations, args.out, args.aux_layers, args.progress) == ("c.jsonl", "store", "2,4,5", False)
    assert (args.max_length, args.tensor_parallel_size, args.backend) == (256, 2, "vllm")
    assert _parse(["capture", f"--config={r}"]).max_length == 4096


def test_a_repeatable_flag_given_replaces_the_recipes_list(tmp_path):
    r = _write(tmp_path, '[generate]\ninput = "p.jsonl"\nout = "o.jsonl"\nserver_url = ["http://a", "http://b"]\n')
    assert _parse(["generate", "--config", r]).server_url == ["http://a", "http://b"]
    assert _parse(["generate", "--config", r, "--server-url", "http://c"]).server_url == ["http://c"]


def test_an_exclusive_flag_given_replaces_the_recipes_choice(tmp_path):
    r = _write(tmp_path, '[generate]\ninput = "p.jsonl"\nout = "o.jsonl"\n')
    args = _parse(["generate", "--config", r, "--self-prompt", "4"])
    assert (args.input, args.self_prompt) == (None, 4)
    both = _write(tmp_path, '[generate]\ninput = "p.jsonl"\nself_prompt = 3\nout = "o.jsonl"\n')
    with pytest.raises(ValueError, match="exclude each other"):
        _parse(["generate", "--config", both])


def test_serve_takes_its_vllm_arguments_from_the_recipe_unless_given_after_dashes(tmp_path):
    r = _write(tmp_path, '[serve]\ntarget = "T"\ndrafter = "D"\nvllm_args = ["-tp", "8"]\ndry_run = true\n')
    args = _parse(["serve", "--config", r])
    assert (args.target, args.dry_run, args.vllm_args) == ("T", True, ["--", "-tp", "8"])
    assert _parse(["serve", "--config", r, "--", "--port", "1"]).vllm_args == ["--", "--port", "1"]


@pytest.mark.parametrize("text, message", [
    ('[capture]\nmax_lenght = 3\n', "unknown key 'max_lenght': `draftsmith capture` has no such flag; did you mean "
                                     "max_length (--max-length)?"),
    ('[captur]\nmax_length = 3\n', "unknown section [captur]; did you mean [capture]?"),
    ('max_length = 3\n', "top-level key 'max_length' is not a [command] section"),
    ('[export]\nout = "x"\n', "no [capture] section (it has [export])"),
    ('[capture]\nmax_length = "long"\n', "max_length = 'long': invalid literal"),
    ('[capture]\nmax_length = 2.5\n', "max_length wants int, not 2.5"),
    ('[capture]\nbackend = "sglang"\n', "backend = 'sglang': choose from hf, vllm"),
    ('[capture]\nno_progress = "yes"\n', "no_progress is a switch"),
    ('[capture]\nmax_length = 3\nmax-length = 4\n', "set the same flag"),
    ('[capture\n', "not valid TOML"),
])
def test_a_bad_recipe_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    r = _write(tmp_path, text)
    assert main(["capture", "--config", r, "--conversations", "c", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("draftsmith: error: ") and message in err, err


def test_a_missing_recipe_is_exit_2(tmp_path, capsys):
    assert main(["doctor", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "no such recipe file" in capsys.readouterr().err


def test_every_command_takes_config_and_train_keeps_its_own(tmp_path):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert any("--config" in a.option_strings for a in p._actions), name
    # train reads its [train] section itself (stages/train/config.py): flat files keep working there
    assert "config" not in recipe_keys(parser, "capture") and "max_length" in recipe_keys(parser, "capture")


# --- the shipped recipes ------------------------------------------------------------------------------------
def test_recipes_are_shipped():
    assert {p.name for p in RECIPES} >= {"dense-8b.toml", "deepseek-v3-moe.toml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_section_loads_and_every_key_is_a_flag(recipe):
    from draftsmith.stages.train.config import load_config

    sections = tomllib.loads(recipe.read_text())
    assert {"generate", "capture", "train", "export", "doctor", "serve"} <= set(sections)
    for command, section in sections.items():
        if command == "train":
            cfg = load_config(recipe)  # unknown keys raise, naming the closest
            assert cfg.store == section["store"] and cfg.ttt_steps == section["ttt_steps"]
            continue
        keys = recipe_keys(build_parser(), command)
        assert {k.replace("-", "_") for k in section} <= set(keys), command
        args = _parse([command, "--config", str(recipe)])
        for key, value in section.items():
            if key != "vllm_args":
                want = ",".join(map(str, value)) if isinstance(value, list) and key != "server_url" else value
                assert getattr(args, key) == (str(want) if isinstance(getattr(args, key), str) else want), key


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_stages_of_a_recipe_hand_their_outputs_on(recipe):
    s = tomllib.loads(recipe.read_text())
    assert s["capture"]["conversations"] == s["generate"]["out"]
    assert s["train"]["store"] == s["capture"]["out"]
    assert s["export"]["drafter"] == str(Path(s["train"]["out"]) / "best")
    assert s["doctor"]["drafter"] == s["serve"]["drafter"] == s["export"]["out"]
    assert s["capture"]["target"] == s["train"]["target"] == s["doctor"]["target"] == s["serve"]["target"]
    assert s["export"]["format"] == "vllm" and s["train"]["max_length"] <= s["capture"]["max_length"]


def _commented_commands(recipe: Path) -> list[list[str]]:
    """The `draftsmith ...` and `torchrun ... -m draftsmith.cli ...` lines of the recipe's comments, as argv."""
    out = []
    for line in recipe.read_text().splitlines():
        m = re.match(r"#\s{2,}(draftsmith|torchrun) (.*)", line)
        if m:
            words = shlex.split(m.group(2), comments=True)
            if m.group(1) == "torchrun":
                words = words[words.index("draftsmith.cli") + 1:]
            out.append(words)
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_commands_in_a_recipes_comments_parse_with_it(recipe, monkeypatch):
    from draftsmith.stages.train.config import TrainConfig, load_config

    monkeypatch.chdir(ROOT)
    commands = _commented_commands(recipe)
    assert {c[0] for c in commands} >= {"generate", "capture", "train", "export", "doctor", "serve"}
    for argv in commands:
        assert "--config" in argv and argv[argv.index("--config") + 1] == str(recipe.relative_to(ROOT)), argv
        args = _parse(argv)
        if args.command == "train":
            load_config(args.config, {k: getattr(args, k) for k in TrainConfig.fields()})


# --- end to end on CPU --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cwd: Path, *argv: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    launcher = [sys.executable, "-m", "draftsmith.cli"]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(_free_port()), "-m", "draftsmith.cli"]
    proc = subprocess.run([*launcher, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{shlex.join(argv)}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def _prompts(path: Path, n: int) -> Path:
    from draftsmith.testing.models import tiny_chat_corpus

    with open(path, "w") as f:
        for i, conv in enumerate(tiny_chat_corpus(n, seed=1)):
            f.write(json.dumps({"id": f"p-{i}", "messages": conv[:1]}) + "\n")
    return path


def _recipe_end_to_end(tmp_path: Path, recipe: Path, target: Path, capture_extra: tuple[str, ...] = ()) -> None:
    """generate -> capture -> torchrun train (2 gloo ranks) -> export -> doctor -> serve --dry-run, each with
    `--config RECIPE` and only the overrides the module docstring lists; the recipe's paths under tmp_path."""
    s = tomllib.loads(recipe.read_text())
    r, t = str(recipe), str(target)
    prompts = _prompts(tmp_path / "prompts.jsonl", 12)

    _run(tmp_path, "generate", "--config", r, "--backend", "local", "--target", t, "--tokenizer", t,
         "--input", str(prompts), "--max-new-tokens", "24", "--device", "cpu", "--no-progress")
    conversations = tmp_path / s["generate"]["out"]
    assert len(conversations.read_text().splitlines()) == 12

    proc = _run(tmp_path, "capture", "--config", r, "--target", t, "--device", "cpu", "--draft-vocab-size", "128",
                "--no-progress", "--json", *capture_extra)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["counts"]["captured"] == 12, report
    assert (tmp_path / s["capture"]["out"] / "vocab.safetensors").is_file()

    _run(tmp_path, "train", "--config", r, "--target", t, "--device", "cpu", "--max-steps", "4",
         "--batch-tokens", "512", "--eval-fraction", "0.25", "--eval-every", "2", "--save-every", "2",
         "--no-progress", "--no-plot", torchrun=True)
    run = tmp_path / s["train"]["out"]
    saved = json.loads((run / "config.json").read_text())
    for key in ("ttt_steps", "lr", "autocast", "max_length", "grad_accum", "step_decay"):
        assert saved[key] == s["train"][key], key  # taken from the recipe
    assert saved["store"] == s["train"]["store"] and saved["max_steps"] == 4
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000004"
    assert (run / "best" / "model.safetensors").is_file()

    proc = _run(tmp_path, "export", "--config", r, "--json")
    exported = tmp_path / s["export"]["out"]
    assert json.loads((exported / "config.json").read_text())["draft_vocab_size"] == 128
    assert json.loads(proc.stdout)["format"] == "vllm"

    proc = _run(tmp_path, "doctor", "--config", r, "--target", t, "--json")
    doctor = json.loads(proc.stdout)
    assert doctor["exit_code"] == 0 and not doctor["blocking"], doctor["findings"]

    proc = _run(tmp_path, "serve", "--config", r, "--target", t, "--dry-run")
    cmd = shlex.split(proc.stdout.strip().splitlines()[-1])
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(exported.resolve()),
                    "num_speculative_tokens": s["serve"]["num_speculative_tokens"]}
    assert cmd[cmd.index("--port") + 1] == str(s["serve"]["port"])
    tail = s["serve"].get("vllm_args", [])
    assert cmd[len(cmd) - len(tail):] == tail


def _eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("eval")]


@pytest.mark.slow
def test_dense_8b_recipe_end_to_end_on_a_tiny_qwen3(tmp_path):
    from draftsmith.testing.models import save_tiny_target

    recipe = ROOT / "recipes" / "dense-8b.toml"
    target = save_tiny_target(tmp_path / "models" / "tiny-qwen3", "qwen3", "chatml")
    _recipe_end_to_end(tmp_path, recipe, target)
    s = tomllib.loads(recipe.read_text())
    # Under torchrun each rank scores its share of the held-out set and the sums are reduced: the tokens scored
    # are the single-process run's (each rank scoring all of it counted them, and the loss, twice).
    _run(tmp_path, "train", "--config", str(recipe), "--target", str(target), "--device", "cpu", "--max-steps", "2",
         "--batch-tokens", "512", "--eval-fraction", "0.25", "--eval-every", "2", "--out", "runs/single",
         "--no-progress", "--no-plot")
    two, one = (_eval_rows(tmp_path / out) for out in (s["train"]["out"], "runs/single"))
    assert len(two) == 2 and len(one) == 1 and two[0]["tokens"] == one[0]["tokens"] > 0, (two, one)
    _run(tmp_path, "bench", "--config", str(recipe), "--target", str(target), "--device", "cpu",
         "--datasets", "mt-bench", "--limit", "1", "--turns", "1", "--max-new-tokens", "8", "--no-progress")
    assert json.loads((tmp_path / s["bench"]["out"] / "bench.json").read_text())


@pytest.mark.slow
def test_deepseek_v3_moe_recipe_end_to_end_on_a_tiny_deepseek_v3(tmp_path):
    from draftsmith.testing.models import save_tiny_deepseek_target

    recipe = ROOT / "recipes" / "deepseek-v3-moe.toml"
    target = save_tiny_deepseek_target(tmp_path / "models" / "tiny-deepseek-v3")
    assert tomllib.loads(recipe.read_text())["capture"]["backend"] == "vllm"
    _recipe_end_to_end(tmp_path, recipe, target, capture_extra=("--backend", "hf"))


# --- bench/gpu_check.sh ---------------------------------------------------------------------------------------
def test_every_draftsmith_command_in_gpu_check_parses():
    """The script runs only where a GPU is lent: every draftsmith command in it must at least parse, with the
    values its GPU branch sets (``VAR=${VAR:-value}`` in the ``else`` of the dry-run test)."""
    text = (ROOT / "bench" / "gpu_check.sh").read_text().replace("\\\n", " ")
    gpu_branch = text[text.index("else\n    DEVICE=cuda"):text.index("\nfi\n", text.index("else\n    DEVICE=cuda"))]
    values = dict(re.findall(r"(\w+)=\$\{\w+:-([^}]*)\}", gpu_branch))
    values["DEVICE"] = "cuda"
    assert values["MINUTES"] == "4"
    prefix = '"${DS[@]}" '
    commands = [line.strip().removeprefix(prefix) for line in text.splitlines() if line.strip().startswith(prefix)]
    assert [c.split()[0] for c in commands] == ["generate", "train", "bench"]
    for command in commands:
        argv = shlex.split(re.sub(r'\$(\w+)', lambda m: values.get(m.group(1), f"/tmp/{m.group(1)}"), command))
        args = build_parser().parse_args(argv)
        assert args.device == "cuda", argv
        if args.command == "train":
            from draftsmith.stages.train.config import TrainConfig, load_config

            cfg = load_config(None, {k: getattr(args, k) for k in TrainConfig.fields()})
            assert cfg.max_minutes == 4 and cfg.conversations and not cfg.store

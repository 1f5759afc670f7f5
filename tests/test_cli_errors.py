"""Bad command-line input: one line ``replayssm CMD: error: ...`` on stderr, exit status
2, no traceback, and nothing done before it (every case here fails in validation,
before a model or pool is built, so the whole file runs in seconds). Also: every
option has a help text, the top-level help names every command in plain text, the
list options are comma lists, and CPU runs get their thread count from one place."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from replayssm import cli
from replayssm.testing.checkpoints import save_tiny_checkpoint

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny checkpoint without an MTP head, a directory holding a config of an
    unsupported model type, and copies of the checkpoint each broken in one way."""
    ck = tmp_path_factory.mktemp("ck")
    save_tiny_checkpoint(ck, "qwen3_5", seed=int(torch.initial_seed() % 1000), with_mtp=False)
    other = tmp_path_factory.mktemp("llama")
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = json.loads((ck / "config.json").read_text())

    def variant(name, drop=(), **config_changes):
        path = tmp_path_factory.mktemp(name)
        for f in ck.iterdir():
            if f.name not in drop:
                shutil.copy(f, path / f.name)
        if config_changes:
            (path / "config.json").write_text(json.dumps({**config, **config_changes}))
        return str(path)

    corrupt = variant("corrupt")
    (Path(corrupt) / "config.json").write_text('{"model_type": "qwen3_5_text", "vocab_size": 26')
    return {
        "ck": str(ck), "llama": str(other), "missing": str(other / "nope"), "corrupt": corrupt,
        "noweights": variant("noweights", drop=("model.safetensors",)),
        "notokenizer": variant("notokenizer", drop=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")),
        "bigtokenizer": variant("bigtokenizer", vocab_size=200),  # the byte tokenizer has 257 tokens
        # positions far past anything a KV cache could hold: the memory check must speak first
        "longctx": variant("longctx", max_position_embeddings=2**50),
    }


CASES = [
    # bench kernels
    ("bench kernels", ["--window", "0"], "--window"),
    ("bench kernels", ["--ring-len", "4"], "--ring-len"),
    ("bench kernels", ["--repeats", "0"], "--repeats"),
    ("bench kernels", ["--layers", "0"], "--layers"),
    ("bench kernels", ["--accept", "0"], "--accept"),
    ("bench kernels", ["--accept", "5"], "--accept"),
    ("bench kernels", ["--heads", "3", "--value-heads", "4"], "--value-heads"),
    ("bench kernels", ["--batches", "1,,2"], "empty item"),
    ("bench kernels", ["--strategies", "fold", "circular"], "unrecognized"),
    ("bench kernels", ["--json", "{tmp}/k.txt"], ".json"),
    ("bench kernels", ["--json", "{tmp}/no/such/dir/k.json"], "does not exist"),
    # demo
    ("demo", ["--window", "0"], "--window"),
    ("demo", ["--requests", "0"], "--requests"),
    ("demo", ["--layers", "0"], "--layers"),
    ("demo", ["--ring-len", "4"], "ring_len"),
    ("demo", ["--ring-len", "6"], "power of two"),
    ("demo", ["--window", "100"], "ring_len"),
    ("demo", ["--steps", "0"], "--steps"),
    # generate
    ("generate", ["--model", "{missing}", "--prompt", "x"], "does not exist"),
    ("generate", ["--model", "{llama}", "--prompt", "x"], "llama"),
    ("generate", ["--model", "{tmp}", "--prompt", "x"], "config.json"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--top-p", "0"], "--top-p"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--top-p", "2"], "--top-p"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--top-k", "-1"], "--top-k"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--dtype", "float8"], "--dtype"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--state-dtype", "float16"], "--state-dtype"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--draft", "model"], "--draft-model"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--draft", "mtp"], "mtp"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--num-draft", "0"], "--num-draft"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--strategy", "nope"], "--strategy"),
    # the user's cases: each a one-line error before anything is loaded
    ("generate", ["--model", "{ck}", "--prompt", "ab\udcffc"], "--prompt: not UTF-8 text (byte 0xff at position 2)"),
    ("generate", ["--model", "{noweights}", "--prompt", "x"], "holds no weights"),
    ("generate", ["--model", "{bigtokenizer}", "--prompt", "x"], "257 tokens, more than the model's vocabulary of 200"),
    ("generate", ["--model", "{notokenizer}", "--prompt", "x"], "has no tokenizer files"),
    ("generate", ["--model", "{corrupt}", "--prompt", "x"], "cannot read {corrupt}/config.json"),
    ("generate", ["--model", "{ck}/config.json", "--prompt", "x"], "is a file; a checkpoint is a directory"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--max-new-tokens", "100000000"],
     "exceed the model's max_position_embeddings 8192"),
    ("generate", ["--model", "{ck}", "--prompt", "x" * 8000, "--max-new-tokens", "193"],
     "the longest prompt (8000 tokens) + 193 new tokens exceed the model's max_position_embeddings 8192"),
    ("generate", ["--model", "{longctx}", "--prompt", "x", "--max-new-tokens", "100000000000"],
     "--max-new-tokens 100000000000: the KV cache (1 slots x 100000000006 tokens"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--num-draft", "100"], "at most 15"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--num-draft", "16"], "at most 15"),
    ("run", ["--num-draft", "100"], "at most 15"),
    ("closed-loop", ["--num-draft", "100"], "at most 15"),
    ("bench e2e", ["--num-draft", "100"], "at most 15"),
    ("bench acceptance", ["--windows", "2,32"], "at most 16"),
    ("bench kernels", ["--device", "cpu", "--backend", "triton", "--window", "17"], "circular's Triton window kernel"),
    ("drift", ["--device", "cpu", "--backend", "triton", "--window", "17", "--ring-len", "64"],
     "circular's Triton window kernel"),
    ("bench e2e", ["--model", "{noweights}"], "holds no weights"),
    ("bench acceptance", ["--model", "{corrupt}"], "cannot read {corrupt}/config.json"),
    ("closed-loop", ["--model", "{notokenizer}"], "has no tokenizer files"),
    ("drift", ["--model", "{ck}/config.json"], "is a file"),
    ("closed-loop", ["--model", "{ck}", "--tokens", "9000"], "max_position_embeddings 8192"),
    # run
    ("run", ["--strategies", "fold", "circular"], "unrecognized arguments: circular"),
    ("run", ["--strategies", "fold,ring"], "--strategies"),
    ("run", ["--batch", "0"], "--batch"),
    ("run", ["--threads", "0"], "--threads"),
    # drift
    ("drift", ["--plot", "{tmp}/x.txt"], ".png"),
    ("drift", ["--json", "{tmp}/x.png"], ".json"),
    ("drift", ["--tokens", "50", "--every", "10"], "at least 10 samples"),
    ("drift", ["--ring-len", "12"], "ring_len"),
    ("drift", ["--inputs", "random", "--decay-range", "0.5,0.1"], "decay_range"),
    ("drift", ["--requests", "0"], "--requests"),
    ("drift", ["--inputs", "random", "--key-correlation", "1.0"], "key_correlation"),
    ("drift", ["--inputs", "fake"], "--inputs"),
    ("drift", ["--shape", "tiny"], "--shape applies to --inputs random only"),
    ("drift", ["--decay-range", "0.01,0.5"], "--decay-range applies to --inputs random only"),
    ("drift", ["--key-correlation", "0.3"], "--key-correlation applies to --inputs random only"),
    ("drift", ["--inputs", "random", "--layer", "0"], "--layer applies to --inputs model only"),
    ("drift", ["--inputs", "random", "--model", "embedded"], "--model applies to --inputs model only"),
    ("drift", ["--layer", "6"], "below the model's 6 GDN layers"),
    ("drift", ["--layer", "-1"], "--layer"),
    ("drift", ["--model", "{missing}"], "does not exist"),
    ("drift", ["--model", "{llama}"], "'llama'"),
    ("drift", ["--excess-factor", "1"], "excess_factor"),
    ("drift", ["--strategies", "none", "--no-control"], "nothing to run"),
    ("drift", ["--strategies", "fold,,circular"], "empty item"),
    # train
    ("train", ["--out", "{ck}"], "not empty"),
    ("train", ["--out", "{tmp}/no/such/t"], "does not exist"),
    ("train", ["--out", "{tmp}/t", "--size", "huge"], "--size"),
    ("train", ["--out", "{tmp}/t", "--vocab", "100"], "--vocab"),
    ("train", ["--out", "{tmp}/t", "--vocab", "0"], "--vocab"),
    ("train", ["--out", "{tmp}/t", "--seq-len", "2"], "--seq-len"),
    ("train", ["--out", "{tmp}/t", "--minutes", "0"], "--minutes"),
    ("train", ["--out", "{tmp}/t", "--steps", "0"], "--steps"),
    ("train", ["--out", "{tmp}/t", "--lr", "-1"], "--lr"),
    ("train", ["--out", "{tmp}/t", "--batch", "x"], "--batch"),
    ("train", ["--out", "{tmp}/t", "--heldout-percent", "100"], "--heldout-percent"),
    ("train", ["--out", "{tmp}/t", "--max-files", "1", "--heldout-percent", "0.001"], "no file is held out"),
    ("train", ["--out", "{tmp}/t", "--tokenizer", "{missing}"], "tokenizer.json"),
    ("train", ["--out", "{tmp}/t", "--source", "{missing}"], "--source"),
    ("train", ["--out", "{tmp}/t", "--save-dtype", "int8"], "--save-dtype"),
    ("train", ["--out", "{tmp}/t", "--threads", "0"], "--threads"),
    # closed-loop
    ("closed-loop", ["--tokens", "0"], "--tokens"),
    ("closed-loop", ["--tokens", "50", "--every", "100"], "--every"),
    ("closed-loop", ["--json", "{tmp}/x.txt"], ".json"),
    ("closed-loop", ["--plot", "{tmp}/no/x.png"], "does not exist"),
    ("closed-loop", ["--model", "{missing}"], "checkpoint directory"),
    ("closed-loop", ["--strategies", "fold,ring"], "--strategies"),
    ("closed-loop", ["--model", "tiny", "--prompt", "x"], "--prompt"),
    ("closed-loop", ["--dtype", "float8"], "--dtype"),
    ("closed-loop", ["--generator", "graph"], "--generator"),
    # bench memory
    ("bench memory", ["--context", "1,,2"], "empty item"),
    ("bench memory", ["--tp", "3"], "divisible"),
    ("bench memory", ["--plot", "{tmp}/m.svg"], ".png"),
    ("bench memory", ["--mem-fraction", "0"], "--mem-fraction"),
    ("bench memory", ["--conv-layout", "flat"], "--conv-layout"),
]
CUDA_CASES = [
    ("bench kernels", ["--device", "cuda"], "CUDA"),
    ("generate", ["--model", "{ck}", "--prompt", "x", "--device", "cuda"], "CUDA"),
    ("run", ["--device", "cuda"], "CUDA"),
    ("drift", ["--device", "cpu", "--backend", "triton"], "triton"),
    ("drift", ["--device", "cuda"], "CUDA"),
    ("train", ["--out", "{tmp}/t", "--device", "cuda"], "CUDA"),
    ("closed-loop", ["--device", "cuda"], "CUDA"),
]


def _check_one_line_error(cmd, argv, expect, model_dirs, tmp_path, capsys):
    paths = {**model_dirs, "tmp": str(tmp_path)}
    argv = [a.format(**paths) for a in argv]
    expect = expect.format(**paths)
    rc = cli.main([*cmd.split(), *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    assert "Traceback" not in err and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"replayssm {cmd}: error: "), err
    assert expect in lines[0], err


@pytest.mark.parametrize("cmd,argv,expect", CASES, ids=[f"{c}:{' '.join(a)}" for c, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(cmd, argv, expect, model_dirs, tmp_path, capsys):
    _check_one_line_error(cmd, argv, expect, model_dirs, tmp_path, capsys)


@NO_CUDA
@pytest.mark.parametrize("cmd,argv,expect", CUDA_CASES, ids=[f"{c}:{' '.join(a)}" for c, a, _ in CUDA_CASES])
def test_cuda_without_cuda_is_one_line_and_exit_2(cmd, argv, expect, model_dirs, tmp_path, capsys, monkeypatch):
    from replayssm.ops import triton_common

    monkeypatch.setattr(triton_common, "INTERPRETER", False)  # as on a CPU machine without TRITON_INTERPRET
    _check_one_line_error(cmd, argv, expect, model_dirs, tmp_path, capsys)


@pytest.mark.parametrize("cmd", ["generate --prompt x", "closed-loop"])
def test_a_missing_embedded_checkpoint_is_one_line_naming_the_train_command(cmd, tmp_path, capsys, monkeypatch):
    from replayssm.engine import loading

    monkeypatch.setattr(loading, "embedded_model_dir", lambda name="embedded": tmp_path / "models" / name)
    rc = cli.main([*cmd.split(), "--model", "embedded"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"replayssm {cmd.split()[0]}: error: "), err
    assert "the embedded checkpoint is missing" in err[0] and "replayssm train" in err[0], err


def test_the_kv_cache_check_names_the_figure_and_the_free_memory(model_dirs, capsys):
    """Before the allocation, not inside it: 47 TiB of KV cache (2 slots of 10^11
    positions, 1 attention layer of 2 KV heads x 16, fp32 keys and values) is refused
    with both figures, and the figure is the cache's size."""
    from replayssm.engine.kv_cache import free_memory

    rc = cli.main(["generate", "--model", model_dirs["longctx"], "--prompt", "x", "--max-new-tokens", "100000000000",
                   "--device", "cpu"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1, err
    need = 2 * 1 * 2 * 2 * 100000000006 * 16 * 4 + 2 * 8
    assert f"needs {need / 2**30:.2f} GiB but cpu has " in err[0], err
    free = float(err[0].split(" has ")[1].split(" GiB free")[0])
    assert abs(free - free_memory("cpu") / 2**30) < 0.5 * free_memory("cpu") / 2**30, err  # a live figure


def test_a_bad_command_is_one_line(capsys):
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("replayssm: error: ")


def _all_parsers():
    parser = cli.build_parser()
    return [("", parser)] + list(parser.get_default("_parsers").items())


# ``bench e2e``'s module is rewritten in parallel with this test; add it here once it
# gives every option a help text.
HELP_PENDING: set[str] = set()


def test_every_option_has_a_help_text():
    missing = [
        f"replayssm {name} {'/'.join(action.option_strings)}"
        for name, p in _all_parsers()
        if name not in HELP_PENDING
        for action in p._actions
        if action.option_strings and not action.help
    ]
    assert not missing, missing


def test_top_level_help_lists_every_command_in_plain_text(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "`" not in text
    for name in cli.COMMANDS:
        assert f"\n    {name} " in text, name


def test_strategy_lists_are_comma_separated_everywhere():
    for cmd in (["run"], ["drift"], ["closed-loop"], ["bench", "kernels"], ["bench", "memory"]):
        args = cli.parse([*cmd, "--strategies", "circular,fold"])
        assert tuple(args.strategies) == ("circular", "fold"), cmd


def test_cpu_runs_get_their_threads_from_the_cli():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cli.set_cpu_threads(cli.parse(["run", "--device", "cpu"])) == 1
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert cli.set_cpu_threads(cli.parse(["demo", "--threads", "3"])) == 3
        assert torch.get_num_threads() == 3
        torch.set_num_threads(2)
        assert cli.set_cpu_threads(cli.parse(["info"])) is None  # no compute: torch's default stays
        assert torch.get_num_threads() == 2
        # training's matrix products use every core: torch's default unless --threads
        assert cli.set_cpu_threads(cli.parse(["train", "--out", "x", "--device", "cpu"])) is None
        assert torch.get_num_threads() == 2
        assert cli.set_cpu_threads(cli.parse(["train", "--out", "x", "--device", "cpu", "--threads", "1"])) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

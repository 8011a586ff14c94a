"""The command lines on any model (issue 43): ``python -m qops.llama --model DIR`` and
``python -m qops.llama.eval --model DIR --text FILE`` on a tiny random Llama saved with
``save_pretrained`` beside a small BPE tokenizer trained offline on the bundled text; a
compressed-tensors checkpoint saved by ``--save`` runs again; bad paths give clear errors; the
evaluation's windows spread over the text and carry confidence intervals. CPU only."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from qops.llama import sources  # noqa: E402
from qops.llama.__main__ import main  # noqa: E402
from qops.llama.data import EXCERPT  # noqa: E402
from qops.llama.eval import bootstrap_ci, spread_windows  # noqa: E402
from qops.llama.eval import main as eval_main  # noqa: E402

VOCAB = 320


def _tokenizer():
    """A byte-level BPE of ``VOCAB`` tokens trained on the bundled Jargon excerpt (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([EXCERPT.read_text(encoding="utf-8")], trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("text") / "text.txt"
    f.write_text(EXCERPT.read_text(encoding="utf-8"))
    return f


def test_resolve_kinds_and_bad_paths(model_dir, tmp_path):
    assert sources.resolve(None).kind == "smollm2"
    assert sources.resolve(str(model_dir)).kind == "hf"
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        sources.resolve(tmp_path / "missing")
    (tmp_path / "m.gguf").write_bytes(b"")
    assert sources.resolve(tmp_path / "m.gguf").kind == "gguf"  # read by smollm2.load_model(path=...)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        sources.resolve(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="no config.json.*holds m.gguf: pass that file"):
        sources.resolve(tmp_path)
    awq = tmp_path / "awq"
    awq.mkdir()
    (awq / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quantized with 'awq'"):
        sources.resolve(awq)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_main_model_generates_and_saves(model_dir, tmp_path, capsys, monkeypatch, weights):
    from qops.llama import compressed

    saved = []  # the model the command line saves (its in-memory model)
    real_save = compressed.save_compressed

    def spy(model, *a, **k):
        saved.append(model)
        return real_save(model, *a, **k)

    monkeypatch.setattr(compressed, "save_compressed", spy)
    out = tmp_path / "saved"
    argv = ["--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "4", "--no-progress"]
    rc = main([*argv, "--weights", weights, "--kv-cache", "fp16", "--save", str(out), "--prompt", "The hacker"])
    text = capsys.readouterr().out
    assert rc == 0, text
    label = "W8A8" if weights == "int8" else "W4A16"  # hidden 128: groups of 128
    assert f"[{label}]" in text and "quantized by qops" in text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == ("int-quantized" if weights == "int8" else "pack-quantized")
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    # the saved checkpoint runs again, loaded as it is, with another KV cache
    rc = main(["--model", str(out), "--device", "cpu", "--max-new-tokens", "4", "--kv-cache", "int4", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "loaded as it is" in text and "KV4" in text, text
    # and computes what the model in memory did: bit-identical logits
    assert len(saved) == 1
    mem, back = saved[0], compressed.load_compressed(out, kv_cache="fp16")
    assert back.dtype == mem.dtype == torch.float16 and mem.qcfg.kv_cache == "fp16"
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 127, 64], [3, 3, 100, 12, 0, 45, 6, 90]])
    assert torch.equal(mem.score(ids), back.score(ids))


def test_main_save_refuses_float_linears(model_dir, tmp_path, capsys, monkeypatch):
    """--weights none --save is refused before anything is loaded (exit 2, one line)."""

    def no_load(*a, **k):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(sources, "load_float", no_load)
    out = tmp_path / "saved"
    rc = main(["--model", str(model_dir), "--device", "cpu", "--weights", "none", "--save", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "--weights none" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_main_compressed_keeps_its_dtype(model_dir, tmp_path, capsys, monkeypatch):
    """A bfloat16 compressed-tensors checkpoint stays bfloat16 without --dtype; --dtype overrides."""
    ckpt = tmp_path / "bf16"
    argv = ["--device", "cpu", "--max-new-tokens", "1", "--no-progress"]
    assert main(["--model", str(model_dir), *argv, "--dtype", "bfloat16", "--save", str(ckpt)]) == 0
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    built = []
    real = sources.load_quantized

    def spy(*a, **k):
        m = real(*a, **k)
        built.append(m.dtype)
        return m

    monkeypatch.setattr(sources, "load_quantized", spy)
    assert main(["--model", str(ckpt), *argv]) == 0
    assert main(["--model", str(ckpt), *argv, "--dtype", "float16"]) == 0
    capsys.readouterr()
    assert built == [torch.bfloat16, torch.float16]


def test_main_smoothquant(model_dir, text_file, capsys):
    rc = main(
        [
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--max-new-tokens",
            "2",
            "--smoothquant",
            "--text",
            str(text_file),
            "--calib-tokens",
            "128",
            "--no-progress",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "+SQ0.5" in text, text


def test_main_bad_model_path(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_main_refuses_mismatched_options(model_dir, capsys, tmp_path):
    assert main(["--model", str(model_dir), "--device", "cpu", "--weights", "int4", "--smoothquant"]) == 2
    assert "--smoothquant applies to --weights int8" in capsys.readouterr().err
    assert main(["--device", "cpu", "--kv-cache", "int4"]) == 2  # the SmolLM2 comparison takes no --kv-cache
    assert "go with --model" in capsys.readouterr().err


def test_spread_windows_cover_the_text():
    t = torch.arange(1000)
    w = spread_windows(t, 100, 4)
    assert w.shape == (4, 100) and int(w[0, 0]) == 0 and int(w[-1, -1]) == 999
    starts = w[:, 0].tolist()
    assert all(b - a >= 100 for a, b in zip(starts, starts[1:]))  # disjoint
    with pytest.raises(ValueError, match="at least"):
        spread_windows(t, 100, 11)


def test_bootstrap_ci():
    x = torch.tensor([1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95])
    lo, hi = bootstrap_ci(x)
    assert lo < float(x.mean()) < hi and hi - lo < 0.4
    assert bootstrap_ci(torch.tensor([2.0])) == (2.0, 2.0)


def test_eval_model_text(model_dir, text_file, tmp_path, capsys):
    eval_main(
        [
            "--model",
            str(model_dir),
            "--text",
            str(text_file),
            "--device",
            "cpu",
            "--tokens",
            "384",
            "--seq-len",
            "64",
            "--calib-tokens",
            "128",
            "--variants",
            "fp16,W8A8+KV8,W4A16",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    md = capsys.readouterr().out
    assert "tiny_llama" in md and "6 windows of 64 spread over" in md
    assert "| W8A8+KV8 |" in md and "| W4A16 |" in md and "95% CI" in md
    with open(tmp_path / "quality_cpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4  # the reference and three variants
    for d in rows:
        assert float(d["ppl_lo"]) <= float(d["ppl"]) <= float(d["ppl_hi"])
        assert float(d["dppl_lo"]) <= float(d["dppl"]) + 1e-12 and float(d["dppl"]) <= float(d["dppl_hi"]) + 1e-12


def test_eval_compressed_checkpoint(model_dir, text_file, tmp_path, capsys):
    """A compressed-tensors checkpoint evaluates against transformers' dequantized load of it,
    its variants being KV-cache choices."""
    ckpt = tmp_path / "ckpt"
    assert main(["--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "1", "--save", str(ckpt)]) == 0
    capsys.readouterr()
    eval_main(
        [
            "--model",
            str(ckpt),
            "--text",
            str(text_file),
            "--device",
            "cpu",
            "--tokens",
            "256",
            "--seq-len",
            "64",
            "--variants",
            "fp16,KV8",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    md = capsys.readouterr().out
    assert "| W8A8 |" in md and "| W8A8+KV8 |" in md, md


def test_eval_bad_model_path(tmp_path, capsys):
    assert eval_main(["--model", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_eval_compressed_default_variants(model_dir, text_file, tmp_path, capsys, monkeypatch):
    """A compressed-tensors checkpoint with the default --variants evaluates its KV-cache choices;
    a variant it cannot take is refused before anything is loaded."""
    ckpt = tmp_path / "ckpt"
    assert main(["--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "1", "--save", str(ckpt)]) == 0
    capsys.readouterr()
    argv = ["--model", str(ckpt), "--text", str(text_file), "--device", "cpu", "--tokens", "128", "--seq-len", "64"]
    rc = eval_main([*argv, "--calib-tokens", "0", "--out", str(tmp_path), "--no-progress"])
    md = capsys.readouterr().out
    assert rc == 0 and "| W8A8+KV8 |" in md and "| W8A8+KV4-w128s4 |" in md, md

    def no_load(*a, **k):
        raise AssertionError("loaded something")

    monkeypatch.setattr(sources, "load_tokenizer", no_load)
    monkeypatch.setattr(sources, "load_reference", no_load)
    for bad in ("fp16,KV8-static", "W4A16"):
        assert eval_main([*argv, "--variants", bad]) == 2
        assert "KV-cache choices without calibration" in capsys.readouterr().err
    assert eval_main([*argv, "--variants", "KV9"]) == 2
    assert "--variants" in capsys.readouterr().err

"""The training command's interface: usage errors, --help, log lines, held-out evaluation,
metrics file and plot, checkpoint integrity, and the optimizer choice without fallback."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import flax_models as fm
import jax_ls2
import jax_ls2.optim
from flax_models import data, metrics, plot, training
from flax_models import train as T
from train_runs import printed_losses, run_main as _main
from numerics import xla_flags_with_devices


def test_make_optimizer_raises_instead_of_falling_back(monkeypatch):
    def adamw(**kw):
        raise TypeError(f"adamw: unexpected keyword {sorted(kw)[0]!r}")

    monkeypatch.setattr(jax_ls2.optim, "adamw", adamw)
    with pytest.raises(TypeError, match="adamw: unexpected keyword"):
        training.make_optimizer(1e-3, 10, 2, fused=True)
    tx, name = training.make_optimizer(1e-3, 10, 2, fused=False)
    assert name == "optax.adamw"


# ---------------------------------------------------------------------------- shared runs
# Three small GPT runs serve every test below: a --compare run that checkpoints, evaluates
# and writes metrics; a resume of it; and a --resume on a directory that does not exist.
TINY = ["--model", "gpt", "--batch", "2", "--seq", "16"]
TOKENS_PER_STEP = 2 * 16


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("train_cli")


@pytest.fixture(scope="module")
def compare_run(ckpt_root):
    ckpt = str(ckpt_root / "ckpt")
    (first, second), out = _main(TINY + ["--steps", "4", "--compare", "--ckpt-dir", ckpt,
                                         "--save-every", "2", "--eval-every", "2",
                                         "--eval-batches", "1", "--log-every", "2"])
    return first, second, out, ckpt


@pytest.fixture(scope="module")
def resumed_run(compare_run):
    _, _, _, ckpt = compare_run
    result, out = _main(TINY + ["--steps", "6", "--ckpt-dir", ckpt, "--resume",
                                "--eval-every", "3", "--eval-batches", "1", "--log-every", "1"])
    return result, out, ckpt


def test_train_command_and_compare(compare_run):
    first, second, out, _ = compare_run
    assert "speedup (plain / jax_ls2 step time)" in out and "loss difference" in out
    assert first["impl"] == "ls2" and second["impl"] == "plain"
    assert second["optimizer"] == "optax.adamw"
    assert len(first["losses"]) == 4 and np.all(np.isfinite(first["losses"]))


def test_saved_and_resumed_lines(compare_run, resumed_run):
    _, _, out, ckpt = compare_run
    assert f"ls2: saved step 2 ({ckpt})" in out and f"ls2: saved step 4 ({ckpt})" in out
    assert "plain: saved" not in out  # the twin does not overwrite the checkpoints
    result, out, _ = resumed_run
    assert f"ls2: resumed from step 4 ({ckpt})" in out
    assert result["start"] == 4 and len(result["losses"]) == 2


def test_resume_on_a_missing_directory_starts_afresh(ckpt_root):
    missing = str(ckpt_root / "does-not-exist")
    result, out = _main(TINY + ["--steps", "1", "--ckpt-dir", missing, "--resume",
                                "--eval-every", "0"])
    assert f"ls2: no checkpoint under {missing}; starting afresh" in out
    assert result["start"] == 0 and len(result["losses"]) == 1


def test_log_lines_have_elapsed_time_and_eta(compare_run):
    _, _, out, _ = compare_run
    for impl in ("ls2", "plain"):
        for step in (2, 4):
            assert re.search(rf"^{impl} step {step}/4 \| loss \d+\.\d{{4}} \| [\d,]+ tokens/s \| "
                             rf"elapsed \d+:\d\d \| ETA \d+:\d\d$", out, re.M), (impl, step, out)


def test_held_out_loss_every_n_steps(compare_run, resumed_run):
    first, second, out, _ = compare_run
    for r in (first, second):
        assert [s for s, _ in r["evals"]] == [2, 4]
        assert all(np.isfinite(v) for _, v in r["evals"])
    # the two implementations evaluate the same weights on the same held-out batches
    np.testing.assert_allclose([v for _, v in first["evals"]], [v for _, v in second["evals"]],
                               rtol=1e-4)
    assert re.search(r"^ls2 step 2: held-out loss \d+\.\d{4} \(1 batches\)$", out, re.M)
    result, _, _ = resumed_run
    assert [s for s, _ in result["evals"]] == [6]  # every 3 steps counted from 0, and the last


def test_held_out_split_is_apart_from_training_data():
    train_files = {p for p, _ in data.source_files("train")}
    eval_files = {p for p, _ in data.source_files("eval")}
    assert eval_files and not train_files & eval_files
    cfg = fm.get_config("gpt")
    held = data.make_batch(cfg, 0, 0, 2, 16, "eval")["input_ids"]
    text = data.text_tokens("eval")
    for row in held:  # each held-out window is a slice of the held-out text
        starts = np.flatnonzero(text[:-16] == row[0])
        assert any(np.array_equal(text[s:s + 16], row) for s in starts)
    for family in fm.FAMILIES:
        c = fm.get_config(family)
        a, b = data.make_batch(c, 0, 0, 2, 16), data.make_batch(c, 0, 0, 2, 16, "eval")
        assert any(not np.array_equal(a[k], b[k]) for k in a), family
    with pytest.raises(ValueError, match="make_batch: split must be one of"):
        data.make_batch(cfg, 0, 0, 2, 16, "test")


def test_metrics_files_per_run(compare_run, resumed_run):
    _, _, _, ckpt = compare_run
    ls2 = metrics.read(os.path.join(ckpt, "metrics.jsonl"))
    plain = metrics.read(os.path.join(ckpt, "metrics-plain.jsonl"))
    assert {r["label"] for r in plain} == {"plain"}
    assert [r["implementation"] for r in plain if r["kind"] == "run"] == ["plain"]
    # the ls2 file: the compare run, then the resumed run appended
    assert [r["start_step"] for r in ls2 if r["kind"] == "run"] == [0, 4]
    assert [r["implementation"] for r in ls2 if r["kind"] == "run"] == ["reference"] * 2
    s = metrics.series(ls2)
    assert s["label"] == "ls2" and s["step"] == [1, 2, 3, 4, 5, 6]
    assert s["eval_step"] == [2, 4, 6]
    assert s["rate_step"] == [2, 3, 4, 6]  # each run's first step compiles: no rate
    assert len(metrics.series(plain)["step"]) == 4


def test_metrics_read_names_a_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"kind": "step", "label": "ls2", "step": 1, "loss": 1.0}\nnot json\n')
    with pytest.raises(ValueError, match=r"m.jsonl line 2 is not JSON"):
        metrics.read(str(path))


def test_speedup_and_throughput_from_the_same_median(compare_run):
    first, second, out, ckpt = compare_run
    summaries = {}
    for name in ("metrics.jsonl", "metrics-plain.jsonl"):
        rec = [r for r in metrics.read(os.path.join(ckpt, name)) if r["kind"] == "summary"][0]
        summaries[rec["label"]] = rec
        # throughput = tokens per step / the median step time
        np.testing.assert_allclose(rec["rate"] * rec["median_ms"] / 1e3, TOKENS_PER_STEP, rtol=1e-9)
    for r in (first, second):
        assert f"step {r['ms_median']:.1f} ms (median after the first step) | " \
               f"{r['rate']:,.0f} tokens/s (from that median)" in out
    speedup = float(re.search(r"speedup \(plain / jax_ls2 step time\): ([\d.]+)x", out).group(1))
    expect = summaries["plain"]["median_ms"] / summaries["ls2"]["median_ms"]
    assert speedup == pytest.approx(expect, abs=0.006)


def test_header_names_the_implementation_and_cpu_speedup_says_reference(compare_run):
    _, _, out, _ = compare_run
    assert ("implementation ls2: jax_ls2 on its pure-JAX reference path, not its CUDA kernels "
            "(backend cpu)") in out
    assert "implementation plain: plain Flax layers (no jax_ls2 code)" in out
    assert "this speedup compares two reference (XLA) paths, not the CUDA kernels" in out


def test_header_uses_jax_ls2_implementation_when_present(monkeypatch):
    monkeypatch.setattr(jax_ls2, "implementation", lambda: "cuda", raising=False)
    assert T.ls2_implementation() == "cuda"
    assert T.describe_impl("ls2") == "ls2: jax_ls2 on its CUDA kernels"


def test_peak_memory_is_na_on_cpu(compare_run):
    first, second, out, ckpt = compare_run
    for r in (first, second):
        assert r["peak_bytes"] is None
        assert r["peak"] == "n/a (cpu reports no device memory statistics)"
    assert out.count("peak memory n/a (cpu reports no device memory statistics)") == 2
    for name in ("metrics.jsonl", "metrics-plain.jsonl"):
        # the first summary is this run's; a resumed run may have appended another
        summary = [r for r in metrics.read(os.path.join(ckpt, name)) if r["kind"] == "summary"][0]
        assert summary["peak_bytes"] is None


class _Device:
    def __init__(self, peaks):
        self.peaks = iter(peaks)

    def memory_stats(self):
        return {"peak_bytes_in_use": next(self.peaks)}


def test_peak_memory_is_measured_per_run(monkeypatch):
    device = _Device([5e9, 7e9, 7e9, 6e9])  # run 1: 5 -> 7 GB; run 2: 7 -> 6... stays at 7
    monkeypatch.setattr(T.jax, "local_devices", lambda: [device])
    run1 = T.PeakMemory()
    assert run1.result() == (7e9, "7.00 GB")
    run2 = T.PeakMemory()  # its own peak stayed below run 1's: not measurable, say so
    assert run2.result() == (None, "<= 6.00 GB (below an earlier run's peak)")


# ---------------------------------------------------------------------------- checkpoints
def _copy(ckpt, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(ckpt, dst)
    return str(dst)


def _resume_error(argv):
    with pytest.raises(SystemExit) as e:
        T.cli(argv)
    return str(e.value.code)


def test_checkpoint_of_another_model_is_refused(compare_run, tmp_path):
    _, _, _, ckpt = compare_run
    msg = _resume_error(["--model", "bert", "--batch", "2", "--seq", "16", "--steps", "6",
                         "--ckpt-dir", _copy(ckpt, tmp_path), "--resume", "--quiet"])
    assert re.search(r"train: restore_checkpoint: the checkpoint of step 4 under \S+ belongs "
                     r"to another model \(saved from gpt/tiny ls2\)", msg), msg


def test_corrupted_array_bytes_are_refused(compare_run, tmp_path):
    _, _, _, ckpt = compare_run
    copy = _copy(ckpt, tmp_path)
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(copy, "4", "state"))
             for f in fs]
    biggest = max(files, key=os.path.getsize)
    raw = bytearray(open(biggest, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(biggest, "wb").write(bytes(raw))
    msg = _resume_error(TINY + ["--steps", "6", "--ckpt-dir", copy, "--resume", "--quiet"])
    assert re.search(r"the checkpoint of step 4 under \S+ is corrupted", msg), msg


def test_checksum_mismatch_is_refused(compare_run, tmp_path):
    _, _, _, ckpt = compare_run
    copy = _copy(ckpt, tmp_path)
    meta_file = os.path.join(copy, "4", "meta", "metadata")
    meta = json.load(open(meta_file))
    meta["sha256"] = "0" * 64
    json.dump(meta, open(meta_file, "w"))
    msg = _resume_error(TINY + ["--steps", "6", "--ckpt-dir", copy, "--resume", "--quiet"])
    assert re.search(r"is corrupted: the arrays' SHA-256 is [0-9a-f]{64}, the one saved with "
                     r"them 0{64}", msg), msg


def _edit_metadata(copy, stored_as, *, recompute_checksum, **fields):
    """Sets ``fields`` in the metadata of ``copy``'s checkpoint stored as step ``stored_as``;
    returns the file."""
    meta_file = os.path.join(copy, str(stored_as), "meta", "metadata")
    meta = json.load(open(meta_file))
    meta.update(fields)
    if recompute_checksum:
        meta["meta_sha256"] = training.metadata_checksum(meta)
    json.dump(meta, open(meta_file, "w"))
    return meta_file


@pytest.mark.parametrize("recompute_checksum, expected", [
    # the metadata edited alone: its checksum no longer matches
    (False, r"the checkpoint of step 4 under \S+ is corrupted: the SHA-256 of its metadata {meta} is "
            r"[0-9a-f]{{64}}, the one saved in it [0-9a-f]{{64}}"),
    # the checksum redone too: the step disagrees with the directory it is stored under
    (True, r"the checkpoint of step 4 under \S+ is corrupted: its metadata {meta} gives step 6$"),
], ids=["edited", "edited-with-its-checksum-redone"])
def test_edited_metadata_step_is_refused(compare_run, tmp_path, recompute_checksum, expected):
    _, _, _, ckpt = compare_run
    copy = _copy(ckpt, tmp_path)
    meta_file = _edit_metadata(copy, 4, recompute_checksum=recompute_checksum, step=6)
    msg = _resume_error(TINY + ["--steps", "8", "--ckpt-dir", copy, "--resume", "--quiet"])
    assert re.search(expected.format(meta=re.escape(meta_file)), msg), msg


def test_step_its_optimizer_did_not_count_is_refused(compare_run, tmp_path):
    _, _, _, ckpt = compare_run
    copy = _copy(ckpt, tmp_path)
    shutil.move(os.path.join(copy, "2"), os.path.join(copy, "6"))  # the step-2 state, stored as step 6
    meta_file = _edit_metadata(copy, 6, recompute_checksum=True, step=6)
    msg = _resume_error(TINY + ["--steps", "8", "--ckpt-dir", copy, "--resume", "--quiet"])
    assert re.search(rf"the checkpoint of step 6 under \S+ is corrupted: its metadata {re.escape(meta_file)} "
                     r"gives step 6, but the optimizer state \[1\]\['step'\] counts 2 updates, not 6", msg), msg


def test_saving_a_step_the_optimizer_did_not_count_is_refused(tmp_path):
    tx, _ = training.make_optimizer(1e-3, 3, 1)
    _, state = training.create(fm.get_config("gpt", "tiny"), impl="ls2", dtype=None, seed=0, tx=tx)
    with pytest.raises(ValueError, match=r"save_checkpoint: step is 3, but the optimizer state "
                                         r"\[1\]\['step'\] counts 0 updates, not 3"):
        training.save_checkpoint(str(tmp_path / "ckpt"), 3, state)
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------- usage
@pytest.mark.parametrize("extra, message", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--seq", "-1"], "--seq must be at least 1, got -1"),
    (["--max-len", "0"], "--max-len must be at least 1, got 0"),
    (["--seq", "256"], "--seq 256 exceeds the 128 positions of gpt/tiny; give --max-len 256"),
    (["--lr", "-0.1"], "--lr must be a finite number >= 0, got -0.1"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--log-every", "0"], "--log-every must be at least 1, got 0"),
    (["--eval-every", "-1"], "--eval-every must be >= 0 (0 = never), got -1"),
    (["--save-every", "5"], "--save-every needs --ckpt-dir"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--compare", "--resume", "--ckpt-dir", "x"], "--compare and --resume cannot be combined"),
    (["--dropout", "1.0"], "--dropout must be in [0, 1), got 1.0"),
    (["--preset", "base"], "--preset for gpt must be one of tiny, small, medium, got 'base'"),
    (["--mlm-max-predictions", "8"], "--mlm-max-predictions applies to bert, not gpt"),
    (["--compare", "--attention-backend", "fused"], "--attention-backend fused has no plain-Flax"),
    (["--mesh", "data=2,batch=4"], "--mesh: parse_mesh_spec: unknown axis 'batch'"),
    (["--mesh", "data=3"], "the axis sizes data=3 multiply to 3, but there are 8 devices"),
    (["--mesh", "tensor=8"], "tensor=8 does not divide the 4 heads of gpt/tiny"),
    (["--mesh", "data=2,pipe=4"], "pipe=4 does not divide the 2 layers of gpt/tiny"),
    (["--mesh", "data=8", "--batch", "4"], "data=8 does not divide --batch 4"),
    (["--mesh", "data=4,pipe=2", "--compare"], "--mesh: pipe=2 cannot be combined with --compare"),
    (["--mesh", "data=4,tensor=2", "--compare"], "tensor=2 cannot be combined with --compare"),
    (["--mesh", "data=8", "--sequence-parallel"], "--sequence-parallel needs --mesh with tensor above 1"),
    (["--zero1"], "--zero1 needs --mesh"),
    (["--mesh", "data=8", "--zero1", "--optimizer", "optax"], "--zero1 needs the fused optimizer"),
    (["--model", "vit", "--mesh", "data=4,tensor=2"], "vit cannot be split over the tensor axis"),
    (["--model", "vit", "--seq", "16"], "--seq applies to token sequences; vit takes images"),
])
def test_usage_errors_before_any_training(monkeypatch, capsys, extra, message):
    monkeypatch.setattr(T, "train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as e:
        T.main(["--model", "gpt"] + extra)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_max_len_trains_sequences_longer_than_the_preset(monkeypatch):
    """``--max-len`` grows the position table so ``--seq`` can pass the preset's 128."""
    seen = {}
    monkeypatch.setattr(T, "train", lambda args, cfg, batch, seq, **k: seen.update(cfg=cfg, seq=seq) or {})
    monkeypatch.setattr(T, "summary", lambda result: "")
    T.main(["--model", "gpt", "--preset", "tiny", "--seq", "256", "--max-len", "256", "--steps", "1"])
    assert seen["cfg"].max_len == 256 and seen["seq"] == 256
    model = fm.build(seen["cfg"])
    assert model.embed.positions.embedding.get_value().shape[0] == 256


def test_help_has_a_line_and_a_default_for_every_flag(capsys):
    parser = T.build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        assert "(default: " in action.help or "(required)" in action.help, action.option_strings
    with pytest.raises(SystemExit) as e:
        T.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for family, presets in fm.PRESETS.items():
        assert f"{family}: {', '.join(presets)}" in text
    from jax_ls2.nn.attention import BACKENDS
    assert f"one of {', '.join(BACKENDS)}" in text


# ---------------------------------------------------------------------------- plot
def test_plot_without_matplotlib_says_so(compare_run, tmp_path):
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed; this checks the message given without it")
    _, _, _, ckpt = compare_run
    with pytest.raises(SystemExit, match="plot: matplotlib is not installed"):
        plot.main([os.path.join(ckpt, "metrics.jsonl"), "-o", str(tmp_path / "loss.png")])


def test_plot_draws_both_runs(compare_run, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot command draws with matplotlib, "
                                             "which is not installed here")
    _, _, _, ckpt = compare_run
    out = str(tmp_path / "loss.png")
    plot.main([os.path.join(ckpt, "metrics.jsonl"), os.path.join(ckpt, "metrics-plain.jsonl"),
               "-o", out])
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- mesh
MESH_RUN = ["--model", "gpt", "--preset", "tiny", "--batch", "8", "--seq", "16", "--steps", "3",
            "--dropout", "0.1", "--eval-every", "0", "--log-every", "1"]


@pytest.fixture(scope="module")
def one_device_run():
    return _main(MESH_RUN)


def test_data_mesh_with_zero1_prints_the_same_losses(one_device_run):
    want, want_out = one_device_run
    got, out = _main(MESH_RUN + ["--mesh", "data=8", "--zero1"])
    assert "mesh data=8 (8 devices, 1 processes)" in out
    assert "jax_ls2.optim.adamw (state split over data=8 (ZeRO-1))" in out
    assert len(printed_losses(out, 3)) == 3 and printed_losses(out, 3) == printed_losses(want_out, 3)
    # batch split over 8 devices with dropout on: the same masks, the sums in another order
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
    _, opt = nnx.merge(got["graphdef"], got["state"])
    (mu,) = jax.tree.leaves(opt.opt_state.mu)
    assert mu.addressable_shards[0].data.size * 8 == mu.size


@pytest.mark.slow
def test_command_on_two_devices_prints_the_same_losses(one_device_run, tmp_path):
    """``python -m flax_models.train ... --mesh data=2`` in a process of 2 CPU devices."""
    want, want_out = one_device_run
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(2), JAX_PLATFORMS="cpu")
    metrics_file = str(tmp_path / "metrics.jsonl")
    done = subprocess.run([sys.executable, "-m", "flax_models.train", *MESH_RUN, "--mesh", "data=2",
                           "--metrics", metrics_file], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh data=2 (2 devices, 1 processes)" in done.stdout
    assert printed_losses(done.stdout, 3) == printed_losses(want_out, 3)
    got = [r["loss"] for r in metrics.read(metrics_file) if r["kind"] == "step"]
    np.testing.assert_allclose(got, want["losses"], rtol=1e-6)


@pytest.mark.slow
def test_tensor_and_sequence_parallel_mesh_prints_the_same_losses(one_device_run):
    """GPT split over tensor=2 with Megatron sequence parallelism and ZeRO-1 over data=4,
    started from the one-device run's weights."""
    want, want_out = one_device_run
    got, out = _main(MESH_RUN + ["--mesh", "data=4,tensor=2", "--sequence-parallel", "--zero1"])
    assert "state split over data=4 (ZeRO-1), tensor=2" in out
    assert printed_losses(out, 3) == printed_losses(want_out, 3)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    model, _ = nnx.merge(got["graphdef"], got["state"])
    kernel = model.decoder.layers[0].attn.qkv.kernel.get_value()
    assert "tensor" in str(kernel.sharding.spec)  # split, and kept split by the optimizer


def test_vit_header_names_its_images_not_a_sequence_length():
    _, out = _main(["--model", "vit", "--steps", "1", "--batch", "2", "--eval-every", "0"])
    header = out.splitlines()[0]
    assert header.startswith("vit/tiny: batch 2 x 32x32 images,"), header

"""benchmarks/throughput.py runs end to end on tiny data and reports every contender with sane figures.

No speed is asserted here: the targets live in the benchmark's own report. A contender may
be reported unavailable only while the module it measures does not exist yet; a contender
that crashes fails the test.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import statistics

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "throughput.py")

# contender -> module file whose absence is the only accepted reason for "unavailable"
NEEDS = {
    "growcache_tf": "adapters/tf_dataset.py",
    "growcache_tf_shuffled": "adapters/tf_dataset.py",
    "growcache_torch_1w": "adapters/torch_loader.py",
    "growcache_torch_2w": "adapters/torch_loader.py",
}
GROWTH_NEEDS = {"tf": ("growcache/sampler.py", "adapters/tf_dataset.py"),
                "torch": ("growcache/sampler.py", "adapters/torch_loader.py")}


def _load():
    # By path, as `growcache bench` loads it: benchmarks/ is not a package.
    spec = importlib.util.spec_from_file_location("growcache_bench_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _missing(*paths: str) -> bool:
    return any(not os.path.exists(os.path.join(REPO, p)) for p in paths)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("matplotlib")
    pytest.importorskip("psutil")
    bench = _load()
    out = tmp_path_factory.mktemp("throughput")
    args = bench.parse_args(["--quick", "--json", str(out / "r.json"), "--plots", str(out / "img")])
    args.repeats = 2  # medians of two epochs differ from their min and max, so the checks below can tell
    results = bench.main(args)
    return bench, results, out


@pytest.mark.timeout(420)
def test_every_contender_is_reported(quick):
    bench, results, out = quick
    stored = json.loads((out / "r.json").read_text())
    assert set(stored["raw"]) == set(bench.CONTENDERS)
    for name, raw in results["raw"].items():
        assert not raw.get("failed"), f"{name} crashed: {raw.get('reason')}\n{raw.get('traceback', '')}"
        if not raw["available"]:
            assert name in NEEDS and _missing(NEEDS[name]), f"{name} unavailable: {raw.get('reason')}"
            assert raw["reason"]
    assert stored["machine"]["cpus"] >= 1 and stored["machine"]["versions"]["growcache"]


def test_figures_are_sane(quick):
    bench, results, _ = quick
    assert set(results["figures"]) == {"1MiB", "16KiB"}
    for label, per in results["figures"].items():
        for name, fig in per.items():
            m = fig["MBps"]
            assert 0 < m["min"] <= m["median"] <= m["max"], (label, name)
            assert fig["records_per_s"]["median"] > 0
            assert fig["train_cpu_s_per_GB"]["median"] >= 0 and fig["workers_cpu_s_per_GB"]["median"] >= 0
            assert fig["peak_rss_train_MiB"] > 0
            assert 0 <= fig["first_batch_s"]["median"] <= 60
            assert fig["complete"], f"{label} {name}: {fig['unique_records']} of {fig['records_expected']}"
            if fig["unique_records"] is not None:
                assert fig["ids_in_range"]
                expected_dup = 2.0 if name == "tfrecord_unindexed" else 1.0
                assert fig["duplication"] == expected_dup, (label, name, fig["duplication"])


def _median_MBps(runs: list[dict], nbytes) -> float:
    return statistics.median(nbytes(r) / r["wall_s"] / 1e6 for r in runs)


def test_figures_and_ratios_come_from_the_timed_epochs(quick):
    # Recomputed here from the raw epochs, not read back from the report: the plain read counts
    # file bytes, a contender payload bytes of unique records, and every ratio divides by the
    # plain read of the same run and cache state.
    _, results, _ = quick
    for table, kind in ((results["figures"], "runs"), (results["figures_cold"], "cold")):
        for label, per in table.items():
            size = results["sets"][label]
            plain = _median_MBps(results["raw"]["plain_read"]["sizes"][label][kind], lambda r: size["file_bytes"])
            assert per["plain_read"]["MBps"]["median"] == pytest.approx(plain)
            assert per["plain_read"]["vs_plain"] == pytest.approx(1.0)
            for name, fig in per.items():
                if name.startswith("plain_read"):
                    continue
                runs = results["raw"][name]["sizes"][label][kind]
                payload = size["payload_bytes_per_record"]
                mine = _median_MBps(runs, lambda r: (r["unique_records"] if r["unique_records"] is not None
                                                     else r["records"]) * payload)
                assert fig["MBps"]["median"] == pytest.approx(mine), (label, name, kind)
                assert fig["vs_plain"] == pytest.approx(mine / plain), (label, name, kind)


def test_every_contender_is_warmed_and_checked_alike(quick):
    bench, results, _ = quick
    for name, raw in results["raw"].items():
        if not raw.get("available"):
            continue
        for label, size in raw["sizes"].items():
            assert len(size["runs"]) == results["args"]["repeats"]  # cold epochs are kept apart
            for run in size["runs"]:
                assert run["warm_s"] >= 0
                assert run["resident_before"] > 0.5, (name, label, run["resident_before"])  # warmed just before
            assert len(size["cold"]) == (0 if name == "cuda_ceiling" else 1)
            for run in size["cold"]:
                assert run["resident_before"] is not None  # checked, whether the filesystem let it go or not
            fig = results["figures"][label][name]
            assert fig["resident"]["min"] == min(r["resident_before"] for r in size["runs"])
    assert "Throughput, cold page cache" in results["markdown"]


def test_a_run_that_beats_the_limit_is_not_published(quick, tmp_path):
    bench, results, _ = quick
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n")
    clean = copy.deepcopy(results)
    for cache in ("figures", "figures_cold"):
        for per in clean[cache].values():
            for stat in ("median", "max"):  # cores: the limit
                per["plain_read"]["MBps"][stat] = per["plain_read_cores"]["MBps"][stat] / 2
            top = per["plain_read_cores"]["MBps"]["max"]
            for name, fig in per.items():
                if not name.startswith("plain_read"):
                    fig["MBps"]["median"] = min(fig["MBps"]["median"], top)
    assert bench.limit_violations(clean) == []
    broken = copy.deepcopy(clean)
    per = broken["figures"]["16KiB"]
    per["growcache_torch_2w"]["MBps"]["median"] = per["plain_read_cores"]["MBps"]["max"] * 1.01
    (violation,) = bench.limit_violations(broken)
    assert violation["contender"] == "growcache_torch_2w" and violation["limit"] == "plain_read_cores"
    assert violation["cache"] == "warm" and violation["records"] == "16KiB"
    # The bar is the fastest repeat of either plain read, whichever has the faster median: one
    # reader that once read faster than the contender clears it (a noisy disk's fast repeat).
    lucky = copy.deepcopy(broken)
    lucky["figures"]["16KiB"]["plain_read"]["MBps"]["max"] = per["growcache_torch_2w"]["MBps"]["median"] * 1.01
    assert bench.limit_violations(lucky) == []
    lucky["figures"]["16KiB"]["plain_read"]["MBps"]["max"] = per["plain_read_cores"]["MBps"]["max"] * 1.005
    (violation,) = bench.limit_violations(lucky)
    assert violation["limit"] == "plain_read" and violation["limit_max"] == per["plain_read_cores"]["MBps"]["max"] * 1.005
    broken["limit_violations"] = [violation]
    assert bench.publish(broken, str(docs)) is False
    assert (docs / "benchmarks.md").read_text() == "# Benchmarks\n" and not (docs / "img").exists()
    assert "growcache_torch_2w (16KiB, warm cache)" in bench.markdown(broken)
    clean["limit_violations"] = []
    assert bench.publish(clean, str(docs)) is True
    assert bench.DOC_BEGIN in (docs / "benchmarks.md").read_text()


def test_targets_are_marked(quick):
    _, results, _ = quick
    names = {(t["target"], t["records"]) for t in results["targets"]}
    for label in ("1MiB", "16KiB"):
        for target in ("torch_vs_tf_adapter", "torch_vs_tfrecord_indexed", "torch_vs_plain", "torch_train_cpu",
                       "torch_worker_cpu", "tf_vs_handwritten", "tf_defaults_vs_handwritten",
                       "tf_defaults_cpu_vs_handwritten"):
            assert (target, label) in names
    for t in results["targets"]:
        assert (t["met"] is None) == (t["measured"] is None)


def test_growth_scenario(quick):
    _, results, _ = quick
    assert set(results["growth"]) == {"tf", "torch"}
    for adapter, run in results["growth"].items():
        assert not run.get("failed"), f"growth {adapter} crashed: {run.get('reason')}\n{run.get('traceback', '')}"
        if not run["available"]:
            assert _missing(*GROWTH_NEEDS[adapter]), run["reason"]
            continue
        assert len(run["epochs"]) >= 3
        for epoch in run["epochs"]:
            assert epoch["records"] > 0 and epoch["unique_records"] == epoch["records"]
            assert epoch["first_batch_s"] >= 0 and epoch["sampler_MBps"] >= 0
        assert run["timeline"]


def test_outputs(quick, tmp_path):
    bench, results, out = quick
    assert "| records | contender |" in results["markdown"]
    pngs = results["plots"]
    assert any(p.endswith("throughput.png") for p in pngs)
    for path in pngs:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nHand-written reading stays.\n")
    bench.update_docs(results, str(docs))
    bench.update_docs(results, str(docs))  # a second run replaces its block, never appends another
    text = (docs / "benchmarks.md").read_text()
    assert "Hand-written reading stays." in text
    assert text.count(bench.DOC_BEGIN) == 1 and text.count(bench.DOC_END) == 1
    assert (docs / "img" / "throughput.png").exists()


@pytest.mark.timeout(300)
def test_metrics_on_against_off(tmp_path):
    """--metrics-ab N: growcache's torch loader with its input figures on and off, alternating
    epochs; both medians and their min-max in the JSON and the markdown."""
    pytest.importorskip("torch")
    bench = _load()
    args = bench.parse_args(["--quick", "--contenders", "plain_read", "--no-growth", "--no-cold",
                             "--sizes", "1MiB", "--metrics-ab", "2", "--json", str(tmp_path / "r.json")])
    results = bench.main(args)
    with open(tmp_path / "r.json") as f:
        ab = json.load(f)["metrics_ab"]
    assert ab["available"], ab.get("reason")
    for mode in ("on", "off"):
        figure = ab["MBps"][mode]
        assert figure["repeats"] == 2
        assert 0 < figure["min"] <= figure["median"] <= figure["max"]
        assert f"{figure['median']:.1f} MB/s** ({figure['min']:.1f}-{figure['max']:.1f})" in results["markdown"]
    assert "### Input figures on against off" in results["markdown"]

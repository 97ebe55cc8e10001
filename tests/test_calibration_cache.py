"""The calibration cache (``cluster/instance/calibration.py``): its key, the file's round trip,
corrupt and unwritable caches, ``--recalibrate``, and an instance that starts a second time
loading its profile instead of measuring it."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cluster.conductor.supervisor import free_port
from cluster.instance import calibration
from cluster.instance.calibration import CACHE_ENV, cache_dir, cache_key, cache_path, cached_profile
from cluster.instance.service import InstanceConfig, InstanceService
from cluster.policies.cost_model import DecodeStepModel, InstanceProfile, PrefillCostModel
from engine.config import EngineConfig
from server.cli import instance_args, parse_args
from tests.tiny_models import make_tiny_model, write_safetensors

PROFILE = InstanceProfile(PrefillCostModel(c_uu=1e-9, c_up=5e-10, c_u=2e-6, c_0=3e-3),
                          DecodeStepModel(base_s=1e-3, per_seq_s=2e-4, per_context_token_s=3e-7,
                                          kv_capacity_tokens=4096))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "Qwen3ForCausalLM", tie=False, seed=3)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "calibration"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def _engine(model: Path, num_blocks: int = 64, max_model_len: int = 512, **config) -> SimpleNamespace:
    """What the key reads of an engine, without loading one."""
    config = {"device": "cpu", "threads": 1, **config}
    return SimpleNamespace(config=EngineConfig(model=str(model), **config), model_path=model,
                           stats=lambda: SimpleNamespace(num_blocks=num_blocks), max_model_len=max_model_len)


class _Measure:
    """Stands in for ``calibration.profile``, counting the measurements."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, engine, seed: int = 0) -> InstanceProfile:
        self.calls += 1
        return PROFILE


@pytest.fixture
def measure(monkeypatch: pytest.MonkeyPatch) -> _Measure:
    fake = _Measure()
    monkeypatch.setattr(calibration, "profile", fake)
    return fake


# -- the key ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"quantization": "int8"}, {"kv_cache_dtype": "bfloat16"}, {"threads": 2},
    {"max_num_batched_tokens": 256}, {"max_num_seqs": 8}, {"prefill_chunk_tokens": 128},
    {"chunk_min_prompt_tokens": 64}, {"block_size": 32}, {"enable_prefix_caching": False},
    {"role": "prefill"}, {"role": "decode"}, {"role": "prefill", "stage": (0, 2)},
])
def test_the_key_changes_with_each_engine_setting(model: Path, change: dict) -> None:
    base = {"dtype": "float32", "quantization": "none"}
    assert cache_key(_engine(model, **{**base, **change})) != cache_key(_engine(model, **base))


def test_the_key_changes_with_the_cache_size_context_seed_machine_torch_and_version(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache_key(_engine(model))
    assert cache_key(_engine(model, num_blocks=65)) != key
    assert cache_key(_engine(model, max_model_len=256)) != key
    assert cache_key(_engine(model), seed=1) != key
    with monkeypatch.context() as m:
        m.setattr(calibration, "_cpu", lambda: {"model name": "another CPU", "flags": "sse2"})
        assert cache_key(_engine(model)) != key
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.1")
        assert cache_key(_engine(model)) != key
    with monkeypatch.context() as m:
        m.setattr(calibration, "CALIBRATION_VERSION", calibration.CALIBRATION_VERSION + 1)
        assert cache_key(_engine(model)) != key
    assert cache_key(_engine(model)) == key  # and nothing else in it moves between calls


def test_the_cpu_in_the_key_is_its_model_and_flags() -> None:
    cpu = calibration._cpu()
    if os.path.exists("/proc/cpuinfo"):
        assert cpu.get("model name") or cpu.get("CPU part")
        assert cpu.get("flags") or cpu.get("Features")
    assert "cpu MHz" not in cpu  # the clock changes from one start to the next


def test_the_weights_digest_follows_the_tensor_layout_not_file_times_or_places(
        model: Path, tmp_path: Path) -> None:
    key = cache_key(_engine(model))
    copy = Path(shutil.copytree(model, tmp_path / "copy"))
    os.utime(copy / "model.safetensors", (1, 1))
    assert cache_key(_engine(copy)) == key
    # Another architecture's config, and weights of another shape or dtype, miss.
    other = make_tiny_model(tmp_path / "llama", "LlamaForCausalLM", tie=False, seed=3)
    assert cache_key(_engine(other)) != key
    from safetensors.torch import load_file

    tensors = load_file(str(copy / "model.safetensors"))
    write_safetensors(copy, {k: v.to(torch.bfloat16) for k, v in tensors.items()}, sharded=False)
    assert cache_key(_engine(copy)) != key
    (copy / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()),
                                                  "rms_norm_eps": 1e-5}))
    assert calibration.weights_digest(copy) != calibration.weights_digest(model)


def test_the_cache_directory_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir() == tmp_path / "calibration"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("MOONCAKE_CACHE_DIR", str(tmp_path / "mc"))
    assert cache_dir() == tmp_path / "mc" / "calibration"
    monkeypatch.delenv("MOONCAKE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mooncake-py" / "calibration"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG spec says
    assert cache_dir() == Path.home() / ".cache" / "mooncake-py" / "calibration"


# -- the file --------------------------------------------------------------------------------------

def test_a_measured_profile_is_saved_and_loaded_back(model: Path, measure: _Measure, cache: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(model)
    caplog.set_level(logging.INFO, calibration.__name__)
    assert cached_profile(engine) == PROFILE and measure.calls == 1
    path = cache_path(cache_key(engine))
    # No temporary left; the measuring lock's file stays (removing it could race a waiter).
    assert path.parent == cache and sorted(p.name for p in cache.iterdir()) == sorted([path.name, f".{path.stem}.lock"])
    saved = json.loads(path.read_text())
    assert saved["key"] == cache_key(engine) and saved["profile"] == PROFILE.to_dict()
    assert "measured in" in caplog.text and str(path) in caplog.text
    caplog.clear()
    assert cached_profile(engine) == PROFILE and measure.calls == 1
    assert f"loaded from {path}" in caplog.text
    # Another setting is another file, measured for itself.
    assert cached_profile(_engine(model, threads=2)) == PROFILE and measure.calls == 2
    assert len(list(cache.glob("*.json"))) == 2


def test_a_prefill_profile_without_a_decode_model_round_trips(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefill_only = InstanceProfile(PROFILE.prefill, None)
    monkeypatch.setattr(calibration, "profile", lambda engine, seed=0: prefill_only)
    engine = _engine(model, role="prefill")
    cached_profile(engine)
    monkeypatch.setattr(calibration, "profile", None)  # a second measurement would fail
    assert cached_profile(engine) == prefill_only


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe\x00", b"[1, 2]", b'"text"', b'{"key": 1}',
    None,  # the right key, a profile of the wrong fields
    b"",
])
def test_a_corrupt_cache_file_is_ignored_with_a_warning_and_measured_again(
        model: Path, measure: _Measure, content: bytes | None, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(model)
    path = cache_path(cache_key(engine))
    path.parent.mkdir(parents=True)
    if content is None:
        content = json.dumps({"key": cache_key(engine), "profile": {"prefill": {"x": 1}},
                              "measured_at": time.time()}).encode()
    path.write_bytes(content)
    assert cached_profile(engine) == PROFILE and measure.calls == 1
    assert any(r.levelno == logging.WARNING and str(path) in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["profile"] == PROFILE.to_dict()  # replaced by the new one


def test_a_file_for_another_key_is_not_used(model: Path, measure: _Measure) -> None:
    engine = _engine(model)
    path = cache_path(cache_key(engine))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": cache_key(_engine(model, threads=2)), "profile": PROFILE.to_dict(),
                                "measured_at": time.time()}))
    cached_profile(engine)
    assert measure.calls == 1


def test_an_unwritable_cache_warns_and_still_serves_the_measured_profile(
        model: Path, measure: _Measure, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a file" / "calibration"))
    assert cached_profile(_engine(model)) == PROFILE
    assert "could not save the calibration" in caplog.text


def test_instances_measuring_the_same_key_at_once_measure_it_once(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measuring = threading.Event()
    calls = []

    def slow_measure(engine, seed: int = 0) -> InstanceProfile:
        calls.append(engine.config.threads)
        measuring.set()
        time.sleep(0.5)  # the others ask meanwhile
        return PROFILE

    monkeypatch.setattr(calibration, "profile", slow_measure)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(cached_profile, _engine(model))
        assert measuring.wait(10)
        same = [pool.submit(cached_profile, _engine(model)) for _ in range(2)]
        other = pool.submit(cached_profile, _engine(model, threads=2))  # another key is not held up
        assert other.result(10) == PROFILE
        assert first.result(10) == PROFILE and [f.result(10) for f in same] == [PROFILE, PROFILE]
    assert sorted(calls) == [1, 2], "the same key was measured more than once"


def test_a_lock_held_too_long_is_waited_out_and_the_profile_measured(
        model: Path, measure: _Measure, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(model)
    path = cache_path(cache_key(engine))
    path.parent.mkdir(parents=True)
    monkeypatch.setattr(calibration, "MEASURING_WAIT_S", 0.3)
    with open(path.with_name(f".{path.stem}.lock"), "w") as held:  # a stuck instance holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        assert cached_profile(engine) == PROFILE and measure.calls == 1
        assert 0.3 <= time.monotonic() - started < 5
    assert "measuring here as well" in caplog.text


# -- --recalibrate ---------------------------------------------------------------------------------

def test_recalibrate_measures_again_once_and_restarts_load_the_new_profile(model: Path, measure: _Measure) -> None:
    engine = _engine(model)
    cached_profile(engine)
    after = time.time()  # the Conductor started with --recalibrate
    cached_profile(engine, recalibrate_after=after)
    assert measure.calls == 2
    cached_profile(engine, recalibrate_after=after)  # a restart under the same Conductor
    assert measure.calls == 2


def test_recalibrate_reaches_the_instances_the_conductor_starts() -> None:
    before = time.time()
    args = instance_args(parse_args(["--recalibrate"]))
    after = float(args[args.index("--recalibrate-after") + 1])
    assert before <= after <= time.time()
    # What a started instance parses (the Supervisor puts these after --role and --port).
    assert parse_args(["--role", "decode", *args]).recalibrate_after == after
    assert "--recalibrate-after" not in instance_args(parse_args([]))


# -- an instance, started twice --------------------------------------------------------------------

def _start_instance(model: Path) -> InstanceProfile:
    config = InstanceConfig(
        engine=EngineConfig(model=str(model), device="cpu", role="decode", kv_cache_gib=0.01, threads=1,
                            max_num_batched_tokens=64),
        url=f"http://127.0.0.1:{free_port()}", secret=b"calibration cache test secret", staging_gib=0.01)

    async def run() -> InstanceProfile:
        service = InstanceService(config)
        await service.start()
        try:
            deadline = time.monotonic() + 120
            while not service.ready:
                assert service.error is None, service.error
                assert time.monotonic() < deadline, "the instance did not come up"
                await asyncio.sleep(0.05)
            assert service.info().profile == service.profile.to_dict()
            return service.profile
        finally:
            await service.shutdown()

    return asyncio.run(run())


def test_a_second_instance_start_loads_the_profile_instead_of_measuring(
        model: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, calibration.__name__)
    first = _start_instance(model)
    assert "calibration measured in" in caplog.text and len(list(cache.glob("*.json"))) == 1

    def no_measuring(engine, seed: int = 0) -> InstanceProfile:
        raise AssertionError("the second start measured again")

    monkeypatch.setattr(calibration, "profile", no_measuring)
    caplog.clear()
    assert _start_instance(model) == first
    assert "calibration loaded from" in caplog.text

"""The specdec cache is keyed by content, never by where a checkpoint lies (every clone and venv
shares it), and the embedded target's shipped profile stands in for its first calibration."""

from __future__ import annotations

import hashlib

import pytest

import specdec_core.calibration.target_profile as profile_module
from specdec_core.calibration.profile_types import CalibrationSettings, TargetProfile
from specdec_core.calibration.target_profile import SHIPPED_PROFILES, cached_profile, load_profile, profile_path
from specdec_core.models.loader import ModelSpec
from specdec_core.models.sources import EMBEDDED, converted_gguf_dir, embedded_gguf_path, file_digest

EMBEDDED_CPU = ModelSpec(device="cpu")  # how the shipped profile was measured (with the default settings)


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def copies(tmp_path, files: dict[str, bytes], name: str = "model") -> list:
    """The same checkpoint directory `name` under two different parents."""
    directories = [tmp_path / parent / name for parent in ("clone-a", "elsewhere/clone-b")]
    for directory in directories:
        directory.mkdir(parents=True)
        for file_name, content in files.items():
            (directory / file_name).write_bytes(content)
    return directories


def test_file_digest_is_the_sha256_of_the_bytes_hashed_once_per_version(tmp_path, monkeypatch):
    first, second = (directory / "weights.gguf" for directory in copies(tmp_path, {"weights.gguf": b"q4" * 1000}))
    expected = hashlib.sha256(b"q4" * 1000).hexdigest()
    assert file_digest(first) == file_digest(second) == expected
    with monkeypatch.context() as patch:
        patch.setattr(hashlib, "sha256", lambda *args: pytest.fail("a known version of a file is hashed again"))
        assert file_digest(first) == expected
    second.write_bytes(b"q5" * 1001)
    assert file_digest(second) == hashlib.sha256(b"q5" * 1001).hexdigest()


def test_converted_gguf_dir_is_keyed_by_the_file_content(tmp_path):
    first, second = (directory / "tiny.Q4_1.gguf" for directory in copies(tmp_path, {"tiny.Q4_1.gguf": b"gguf"}))
    assert converted_gguf_dir(first) == converted_gguf_dir(second)
    second.write_bytes(b"fugg")
    assert converted_gguf_dir(first) != converted_gguf_dir(second)


def test_profile_path_is_keyed_by_the_checkpoint_content_and_what_the_measurement_depends_on(tmp_path):
    first, second = copies(tmp_path, {"config.json": b"{}", "model.safetensors": b"weights"})
    settings = CalibrationSettings()
    path = profile_path(ModelSpec(source=str(first)), settings)
    assert path == profile_path(ModelSpec(source=str(second)), settings)
    assert profile_path(ModelSpec(source=str(first), device="cuda:0"), settings) == profile_path(
        ModelSpec(source=str(second), device="cuda:1"), settings
    )  # the device type the forwards run on, not which one
    others = [
        profile_path(ModelSpec(source=str(first), dtype="bfloat16"), settings),
        profile_path(ModelSpec(source=str(first), num_layers=1), settings),
        profile_path(ModelSpec(source=str(first), device="cpu"), settings),
        profile_path(ModelSpec(source=str(first), device="cuda"), settings),
        profile_path(ModelSpec(source=str(first)), CalibrationSettings(max_new_tokens=32)),
        profile_path(ModelSpec(source="HuggingFaceTB/SmolLM2-135M-Instruct"), settings),
    ]
    assert len({*others}) == len(others) and path in others[2:4]  # auto is one of the two
    (second / "model.safetensors").write_bytes(b"retrained")
    assert profile_path(ModelSpec(source=str(second)), settings) not in [path, *others]


def never_measure(*args, **kwargs):
    raise AssertionError("the shipped profile must be used")


def test_the_embedded_targets_shipped_profile_is_used_without_measuring(tmp_path, empty_cache, monkeypatch):
    monkeypatch.setattr(profile_module, "measure_profile", never_measure)
    shipped = SHIPPED_PROFILES / profile_path(EMBEDDED_CPU, CalibrationSettings()).name
    assert shipped.exists()
    profile = load_profile(EMBEDDED_CPU, None, None, CalibrationSettings())
    assert profile == TargetProfile.model_validate_json(shipped.read_text())
    assert profile.settings == CalibrationSettings() and profile.easd_tau_h > 0
    assert not (empty_cache / "profiles").exists()  # read from the package, not copied
    # how the steps run (compiled, graphed) changes no distribution: the same profile
    for how in ({"compile": True}, {"compile_layers": True}, {"cuda_graphs": False}):
        assert profile_path(ModelSpec(source=EMBEDDED, device="cpu", **how), CalibrationSettings()).name == shipped.name
    # the same GGUF named by a path elsewhere is the same target
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / embedded_gguf_path().name).symlink_to(embedded_gguf_path())
    gguf_spec = ModelSpec(source=str(tmp_path / "elsewhere" / embedded_gguf_path().name), device="cpu")
    assert load_profile(gguf_spec, None, None, CalibrationSettings()) == profile


@pytest.mark.parametrize(
    "spec,settings",
    [
        (EMBEDDED_CPU, CalibrationSettings(max_new_tokens=32)),
        (EMBEDDED_CPU, CalibrationSettings(top_fraction=0.1)),
        (ModelSpec(source=EMBEDDED, dtype="int4"), CalibrationSettings()),
        (ModelSpec(source=EMBEDDED, num_layers=20, device="cpu"), CalibrationSettings()),
        (ModelSpec(source=EMBEDDED, device="cuda"), CalibrationSettings()),
        (None, CalibrationSettings()),  # another target
    ],
)
def test_the_shipped_profile_is_not_used_for_other_settings_or_targets(tmp_path, monkeypatch, spec, settings):
    if spec is None:
        spec = ModelSpec(source=str(copies(tmp_path, {"config.json": b"{}"})[0]))
    measured = TargetProfile(easd_tau_h=1.5, num_entropies=7, settings=settings)
    monkeypatch.setattr(profile_module, "measure_profile", lambda *args: measured)
    assert load_profile(spec, None, None, settings) == measured
    assert cached_profile(spec, settings) == measured  # and cached

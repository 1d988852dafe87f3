"""oldgpu.devices: a job's cards are the cards of one profile, never a mix."""

from __future__ import annotations

from pathlib import Path

import pytest

from oldgpu import detect, devices
from oldgpu.output import EngineError

DATA = Path(__file__).parent / "data"
REC = DATA / "detect"


def host(smi: str, lspci: str | None = None) -> list[dict]:
    """Detect's GPUs from recorded outputs."""
    return detect.detect(
        (REC / smi).read_text(),
        (REC / lspci).read_text() if lspci else None,
        DATA / "pci.ids.excerpt",
        run_tools=False,
    )["gpus"]


def card(index: int | None, arch: str, cc: str) -> dict:
    return {"index": index, "name": f"{arch} card", "architecture": arch, "compute_capability": cc}


P40_V100 = host("p40-v100.nvidia-smi.csv")  # 0: P40, 1: V100
EIGHT_P40 = [card(i, "pascal", "6.1") for i in range(8)]
THREE_P40_ONE_V100 = [*(card(i, "pascal", "6.1") for i in range(3)), card(3, "volta", "7.0")]


def choose(gpus, requested, devs=None, **kw):
    return devices.choose_devices(gpus, devices.gpu_profiles(gpus), requested, devs, **kw)


def refusal(gpus, requested, devs=None, **kw) -> str:
    with pytest.raises(EngineError) as info:
        choose(gpus, requested, devs, **kw)
    return info.value.name


def test_profiles_of_each_card():
    assert devices.gpu_profiles(P40_V100) == ["pascal-6.1", "volta-7.0"]
    assert devices.gpu_profiles(EIGHT_P40) == ["pascal-6.1"] * 8


@pytest.mark.parametrize(
    ("requested", "devs", "want"),
    [
        (1, None, [0]),
        (4, None, [0, 1, 2, 3]),
        ("all", None, list(range(8))),
        (8, None, list(range(8))),
        (2, [5, 4], [4, 5]),
        ("all", [6, 7], [6, 7]),
    ],
)
def test_one_profile_host(requested, devs, want):
    assert choose(EIGHT_P40, requested, devs) == want


def test_mixed_host_never_mixes():
    # One GPU: the newest profile that has one (its plan is for that card).
    assert choose(P40_V100, 1) == [1]
    assert choose(P40_V100, 1, profile="pascal") == [0]
    assert choose(P40_V100, "all", profile="volta-7.0") == [1]
    # Two of one profile exist only as P40s, whatever is newer.
    assert choose(THREE_P40_ONE_V100, 2) == [0, 1]
    assert choose(THREE_P40_ONE_V100, 1) == [3]
    assert choose(THREE_P40_ONE_V100, "all", profile="pascal") == [0, 1, 2]


@pytest.mark.parametrize(
    ("gpus", "requested", "devs", "kw", "name"),
    [
        (EIGHT_P40, 9, None, {}, "gpus-exceed-host"),
        (P40_V100, 3, None, {}, "gpus-exceed-host"),
        (P40_V100, 2, None, {}, "gpus-exceed-profile"),
        (THREE_P40_ONE_V100, 2, None, {"profile": "volta"}, "gpus-exceed-profile"),
        (P40_V100, "all", None, {}, "gpus-all-mixed-host"),
        (P40_V100, 1, None, {"profile": "turing"}, "profile-not-on-host"),
        (P40_V100, "all", [0, 1], {}, "devices-mixed-profiles"),
        (THREE_P40_ONE_V100, 2, [2, 3], {}, "devices-mixed-profiles"),
        (EIGHT_P40, "all", [0, 8], {}, "device-unknown"),
        (EIGHT_P40, "all", [0, 0], {}, "devices-invalid"),
        (EIGHT_P40, "all", [], {}, "devices-invalid"),
        (EIGHT_P40, "all", ["0"], {}, "devices-invalid"),
        (EIGHT_P40, 2, [0], {}, "devices-count-mismatch"),
        (P40_V100, 1, [0], {"profile": "volta"}, "devices-profile-mismatch"),
        (EIGHT_P40, 0, None, {}, "gpus-invalid"),
        (EIGHT_P40, -1, None, {}, "gpus-invalid"),
        (EIGHT_P40, True, None, {}, "gpus-invalid"),
        (EIGHT_P40, "2", None, {}, "gpus-invalid"),
    ],
)
def test_refusals(gpus, requested, devs, kw, name):
    assert refusal(gpus, requested, devs, **kw) == name


def test_exceed_host_message_lists_the_cards():
    with pytest.raises(EngineError) as info:
        choose(P40_V100, 3)
    assert "GPU 0: pascal-6.1, GPU 1: volta-7.0" in info.value.message


def test_a_card_the_driver_does_not_drive_is_not_a_choice():
    # Driver 535 drives the A100, not the K80s that lspci also lists.
    gpus = host("k80-a100-535.nvidia-smi.csv", "k80-a100.lspci.txt")
    profiles = devices.gpu_profiles(gpus)
    assert sorted(p for p in profiles if p) == ["ampere-8.0"] and None in profiles
    assert devices.choose_devices(gpus, profiles, "all") == [0]
    with pytest.raises(EngineError) as info:
        devices.choose_devices(gpus, profiles, 2)
    assert info.value.name == "gpus-exceed-host"


def test_profiles_must_line_up_with_gpus():
    with pytest.raises(ValueError):
        devices.choose_devices(EIGHT_P40, ["pascal-6.1"], 1)


def test_visible_devices_env_orders_by_bus():
    assert devices.visible_devices_env([4, 5]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "4,5",
    }

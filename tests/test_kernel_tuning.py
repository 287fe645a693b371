"""The kernel tuning data (src/qerl/kernels/tuning/*.json): `KernelPolicy`'s defaults and the launchers' tile
tables are read from it, so its keys and types are checked against the code here. CPU only, no Triton."""

import dataclasses
import json
from importlib import resources
from pathlib import Path

import pytest

from qerl.kernels import route as rt

THRESHOLDS = {f.name for f in dataclasses.fields(rt.KernelPolicy) if f.type in (int, "int")}


def _file(name: str) -> dict:
    return json.loads((resources.files("qerl.kernels") / "tuning" / name).read_text())


def test_every_threshold_is_in_the_json_and_every_policy_key_is_a_threshold():
    keys = [k for name in rt.TUNING_FILES for k in _file(name).get("policy", {})]
    assert len(keys) == len(set(keys)), "a threshold set in two files"
    assert set(keys) == THRESHOLDS
    for name in rt.TUNING_FILES:
        for key, value in _file(name).get("policy", {}).items():
            assert type(value) is int and value > 0, (name, key, value)  # noqa: E721 (bool is not a threshold)


def test_the_policy_defaults_are_the_json_values():
    p = rt.KernelPolicy()
    assert {k: getattr(p, k) for k in THRESHOLDS} == rt.TUNING["policy"]
    assert p == rt.KernelPolicy(**rt.TUNING["policy"])
    assert rt.current_policy() == p
    # the switches are no tuning data
    assert (p.triton, p.permute_x, p.grad_input_no_temporary, p.disabled) == (None, None, False, frozenset())


def test_a_key_in_two_files_is_refused():
    with pytest.raises(ValueError, match="already set"):
        rt.load_tuning(("default.json", "default.json"))


def test_tile_tables_are_well_formed():
    """Each table is named after the backend it tunes, every row states known conditions, the rows of a table
    give the same tile parameters (int or bool; a string: an int KernelPolicy field), and the last row has no
    condition, so every product finds a row."""
    tables = rt.TUNING["tiles"]
    assert tables and set(tables) <= set(rt.BACKENDS)
    for backend, rows in tables.items():
        assert rows, backend
        names = list(rows[0]["tile"])
        for row in rows:
            assert set(row) <= {*rt.TILE_CONDITIONS, "tile", "programs_per_sm"}, (backend, row)
            assert list(row["tile"]) == names, (backend, row)
            for value in (*row["tile"].values(), *(row.get(c) for c in rt.TILE_CONDITIONS)):
                if isinstance(value, str):
                    assert value in THRESHOLDS, (backend, row)
                else:
                    assert value is None or type(value) in (int, bool), (backend, row)
            assert ("programs_per_sm" in row) == ("programs_per_sm" in rows[0]), (backend, row)
            if "programs_per_sm" in row:
                assert type(row["programs_per_sm"]) in (int, float) and row["programs_per_sm"] > 0, (backend, row)
        last = rows[-1]
        assert all(last.get(c) is None for c in rt.TILE_CONDITIONS), (backend, last)
        for m in (1, 7, 33, 100, 4096):  # found, no LookupError
            assert set(rt.tile_config(backend, m, 4096, 4096, x_permuted=m % 2 == 0)) >= set(names)


def test_tile_config_takes_the_first_matching_row(monkeypatch):
    rows = [
        {"max_m": 8, "x_permuted": True, "tile": {"BM": 1}, "programs_per_sm": 1.0},
        {"max_m": 8, "tile": {"BM": 2}, "programs_per_sm": 2.0},
        {"max_m": "swap_max_m", "min_weight": "big_weight", "tile": {"BM": 3}, "programs_per_sm": 3.0},
        {"max_m": 100, "n_above_k_times": 4, "tile": {"BM": 4}, "programs_per_sm": 4.0},
        {"max_m": 100, "k_above": 8192, "tile": {"BM": 5}, "programs_per_sm": 5.0},
        {"max_m": None, "tile": {"BM": "wide_m_tile"}},
    ]
    monkeypatch.setattr(rt, "_TILES", rt._compile_tiles({"t": rows}))
    p = rt.KernelPolicy(swap_max_m=16, big_weight=1000, wide_m_tile=77)

    def pick(m, n, k, xp=None):
        return rt.tile_config("t", m, n, k, x_permuted=xp, policy=p)

    assert pick(8, 10, 10, True) == {"BM": 1, "programs_per_sm": 1.0}
    assert pick(8, 10, 10, False) == pick(8, 10, 10) == {"BM": 2, "programs_per_sm": 2.0}
    assert pick(16, 10, 100)["BM"] == 3 and pick(16, 10, 99)["BM"] != 3 and pick(17, 10, 100)["BM"] != 3
    assert pick(17, 41, 10)["BM"] == 4 and pick(17, 40, 10)["BM"] != 4
    assert pick(17, 1, 8193)["BM"] == 5 and pick(17, 1, 8192) == {"BM": 77}
    assert pick(101, 41, 8193) == {"BM": 77}  # a row without programs_per_sm gives none
    with rt.kernel_policy(p, wide_m_tile=5):  # policy None: the current one
        assert rt.tile_config("t", 101, 1, 1) == {"BM": 5}
    with pytest.raises(ValueError, match="unknown keys"):
        rt._compile_tiles({"t": [{"max_rows": 8, "tile": {"BM": 1}}]})


def test_the_tuning_files_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["qerl.kernels"]
    folder = Path(rt.__file__).parent
    shipped = {p.name for g in globs for p in folder.glob(g)}
    assert set(rt.TUNING_FILES) <= shipped

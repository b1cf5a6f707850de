"""daemon/budget.py, daemon/memory.py and daemon/units.py: budget and duration parsing,
eviction choice, what a load costs, memory measurement."""

from __future__ import annotations

import math

import psutil
import pytest

from concurrent.futures import Future

from inferd.daemon.budget import Evictable, MemoryBudget, choose_victims
from inferd.daemon.memory import LoadFigures, MemoryMeter, model_cost
from inferd.daemon.model_entry import ModelEntry, State
from inferd.ipc.errors import ErrorCode, InferdError
from inferd.daemon.config import load_config
from inferd.daemon.units import parse_budget, parse_duration
from inferd.ipc.errors import ConfigError


@pytest.mark.parametrize("value, expected", [
    ("512MiB", 512 * 2**20), (1000, 1000), ("1.5GiB", int(1.5 * 2**30)),
    ("unlimited", None), ("0", None),
])
def test_budget_sizes(value, expected):
    assert parse_budget(value) == expected


def test_budget_share_of_physical_memory():
    total = psutil.virtual_memory().total
    assert parse_budget("40%") == int(total * 0.4)
    assert parse_budget("100 %") == total


@pytest.mark.parametrize("value", ["0%", "101%", "-5", "lots", True, -1, 1.5])
def test_bad_budgets(value):
    with pytest.raises(ValueError):
        parse_budget(value)


@pytest.mark.parametrize("value, seconds", [
    (30, 30.0), (0, 0.0), (2.5, 2.5), ("90s", 90.0), ("5m", 300.0), ("1h", 3600.0),
    ("250ms", 0.25), ("forever", math.inf), (-1, math.inf), ("12", 12.0),
])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 weeks", True, float("nan"), None, [1]])
def test_bad_durations(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_cache_config_section_validates_with_a_clear_message(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[cache]\nmax_memory = "lots"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "[cache] max_memory = 'lots': expected a size ('512MiB')" in e.value.message
    path.write_text('[cache]\nmax_memory = "256MiB"\nkeep_alive = "forever"\n')
    cfg = load_config(path)
    assert cfg.cache.max_memory == 256 * 2**20 and math.isinf(cfg.cache.keep_alive)


def test_victims_least_recently_used_first_and_only_as_many_as_needed():
    c = [Evictable("a", 10, last_used=3.0), Evictable("b", 20, last_used=1.0),
         Evictable("c", 30, last_used=2.0)]
    assert [v.key for v in choose_victims(c, 15)] == ["b"]
    assert [v.key for v in choose_victims(c, 25)] == ["b", "c"]
    assert [v.key for v in choose_victims(c, 60)] == ["b", "c", "a"]
    assert choose_victims(c, 61) is None
    assert choose_victims(c, 0) == []


def test_cost_adds_device_memory_but_not_host_memory_twice():
    assert model_cost(100, None, device_memory=False) == 100
    assert model_cost(100, 80, device_memory=False) == 100   # same bytes as the delta
    assert model_cost(100, 400, device_memory=False) == 400
    assert model_cost(100, 400, device_memory=True) == 500   # RSS does not show it
    assert model_cost(-50, None, device_memory=False) == 0   # the heap shrank meanwhile


def test_meter_sees_an_allocation():
    meter = MemoryMeter()
    meter.trim()
    before = meter.rss()
    block = bytearray(64 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    assert meter.rss() - before >= 48 * 2**20
    del block


def _ready(name: str, cost: int, used_at: float) -> ModelEntry:
    """An entry that went through a load to READY, costing ``cost`` bytes (no engine:
    the budget reads only the entry's state, memory and clock)."""
    e = ModelEntry(name, 1, 4)
    e.begin_load(Future())
    e.memory.loaded(LoadFigures(cost, cost, None))
    e.ready(object(), object(), object(), math.inf)  # type: ignore[arg-type]
    e.used_at = used_at
    return e


def test_the_budget_names_victims_and_changes_nothing():
    """The budget is pure (issue 30 item 5): a verdict names what to evict, least
    recently used first, past pinned, busy and kept entries; the entries are untouched
    (the manager performs evictions); what cannot fit is refused naming why."""
    old, busy, pinned, kept, newer = (_ready(n, 30, t) for n, t in
                                      [("old", 1), ("busy", 2), ("pinned", 3), ("kept", 4),
                                       ("newer", 5)])
    busy.in_flight = 1
    entries = [old, busy, pinned, kept, newer]
    budget = MemoryBudget()

    def is_pinned(e: ModelEntry) -> bool:
        return e is pinned

    with kept.keep():
        # 150 in use, 170 of budget: 60 more needs 40 freed, two idle models of 30
        verdict = budget.room(None, 60, "asked", entries, 170, is_pinned)
        assert [v.name for v in verdict.victims] == ["old", "newer"]
        assert verdict.need == 60
        assert all(e.state is State.READY for e in entries)  # nothing evicted by it
        with pytest.raises(InferdError) as e:
            budget.room(None, 81, "asked", entries, 170, is_pinned)  # 60 evictable
        assert e.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert "pinned: pinned version 1 (0.0 MiB)" in e.value.message
        assert "busy, loading or being replaced: busy version 1 (0.0 MiB), kept " \
            "version 1 (0.0 MiB)" in e.value.message
        # a floor that fits where the need cannot
        assert budget.room(None, 81, "asked", entries, 170, is_pinned, floor=40).need == 40
    # kept no longer: a victim before newer (least recently used first)
    assert [v.name for v in budget.room(None, 60, "", entries, 170, is_pinned).victims] \
        == ["old", "kept"]
    assert budget.room(None, 20, "", entries, 170, is_pinned).victims == ()
    assert budget.room(None, 10**12, "", entries, None, is_pinned).victims == ()  # no budget


def test_a_load_reservation_belongs_to_its_entry_and_ends_with_the_load():
    e = ModelEntry("m", 1, 4)
    budget = MemoryBudget()
    e.reserve(100)  # not loading: nothing to reserve
    assert budget.cost(e) == 0
    e.begin_load(Future())
    e.reserve(100)
    assert budget.cost(e) == 100 and budget.used([e]) == 100
    e.fail(ErrorCode.INTERNAL, "broken")
    assert e.reserved == 0 and budget.cost(e) == 0
    e.retry()
    e.begin_load(Future())
    e.reserve(70)
    e.memory.loaded(LoadFigures(60, 60, None))
    e.ready(object(), object(), object(), math.inf)  # type: ignore[arg-type]
    assert e.reserved == 0 and budget.cost(e) == 60  # what it measured, from now on

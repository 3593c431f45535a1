"""KVStats arithmetic: usage, utilisation and fragmentation."""
from kvserve.core.kv.interface import KVStats


def test_stats_arithmetic():
    s = KVStats(num_blocks=10, block_size=4, num_used_blocks=5, used_tokens=15,
                allocated_slots=20, unusable_free_blocks=2)
    assert s.usage == 0.5
    assert s.utilization == 0.75 and s.internal_fragmentation == 0.25
    assert s.external_fragmentation == 2 / 5
    assert s.fragmentation == (5 + 8) / 40  # 5 empty handed-out slots + 2 stranded blocks


def test_empty_pool_is_not_fragmented():
    s = KVStats(num_blocks=8, block_size=16, num_used_blocks=0, used_tokens=0,
                allocated_slots=0)
    assert s.utilization == 1.0 and s.fragmentation == 0.0 and s.external_fragmentation == 0.0

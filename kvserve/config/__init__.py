"""Engine settings: the validated :class:`EngineConfig` parts the components read (the
flat settings users write, :class:`~kvserve.engine.engine_args.EngineArgs`, build them).

The ground floor: these are plain dataclasses that import nothing they configure; a
setting that names a pluggable member (a KV manager, a proposer, a router, ...) is
checked by the layer that registers the members."""
from kvserve.config.cache import CacheConfig
from kvserve.config.engine import EngineConfig
from kvserve.config.model import ModelConfig
from kvserve.config.observability import ObservabilityConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.validate import parse_cpu_list, parse_size
from kvserve.config.worker import WorkerConfig

__all__ = ["EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "WorkerConfig", "ObservabilityConfig", "parse_size", "parse_cpu_list"]

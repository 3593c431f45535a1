"""Engine settings: the flat :class:`EngineArgs` users write, and the validated
:class:`EngineConfig` parts the components read."""
from kvserve.config.cache import CacheConfig
from kvserve.config.engine import EngineConfig
from kvserve.config.engine_args import EngineArgs
from kvserve.config.model import ModelConfig
from kvserve.config.observability import ObservabilityConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.validate import parse_cpu_list, parse_size
from kvserve.config.worker import WorkerConfig

__all__ = ["EngineArgs", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "WorkerConfig", "ObservabilityConfig", "parse_size", "parse_cpu_list"]

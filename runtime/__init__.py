"""The batchgen engine: sequence coroutines over a paged KV cache. Free of Beam imports."""

from runtime.engine import Engine
from runtime.pool import EnginePool
from runtime.request import Completion, Request, SampleOutput
from runtime.sampling import SamplingParams

__all__ = ["Completion", "Engine", "EnginePool", "Request", "SampleOutput", "SamplingParams"]

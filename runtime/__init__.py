"""The batchgen engine: sequence coroutines over a paged KV cache. Free of Beam imports."""

from runtime.engine import Engine
from runtime.pool import EnginePool
from runtime.request import ChatOptions, Completion, Request, SampleOutput
from runtime.sampling import SamplingParams

__all__ = ["ChatOptions", "Completion", "Engine", "EnginePool", "Request", "SampleOutput", "SamplingParams"]

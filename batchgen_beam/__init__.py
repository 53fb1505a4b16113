"""The Beam face of batchgen: the `Generate` transform, the `RunInference` handler, record
validation and I/O. Model math lives in `runtime/`; nothing here computes it."""

from batchgen_beam.generate import Generate
from batchgen_beam.handler import BatchGenModelHandler
from batchgen_beam.io import ReadRecords, WriteRows

__all__ = ["BatchGenModelHandler", "Generate", "ReadRecords", "WriteRows"]

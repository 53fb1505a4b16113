"""The Beam face of batchgen: records in, generation through the engine, output rows out."""

from setuptools import find_packages, setup

# The Triton kernels (kernels/triton/) run CUDA tensors. torch 2.13's CUDA wheels pin
# triton==3.7.1 and the kernels are tested with it; triton ships Linux wheels only.
TRITON = 'triton>=3.7.1,<3.8; platform_system == "Linux"'

setup(
    name="batchgen-beam",
    version="0.1.0",
    description="High-throughput LLM batch generation for Apache Beam (sequence coroutine engine)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["batchgen_beam*", "runtime*", "kernels*", "pipelines*", "benchmarks*"]),
    # kernels/csrc: the C++ CPU attention, JIT-built from source at first use.
    package_data={"batchgen_beam": ["data/*.jsonl"], "kernels": ["csrc/*.cpp", "csrc/*.h"]},
    install_requires=[
        # Never leave torch unpinned: an open range pulls a multi-GB CUDA build on CPU boxes.
        "torch>=2.9,<2.14",  # 2.9: torch._grouped_mm on CPU (MoE experts)
        "ninja>=1.11,<1.14",  # torch's JIT build of the C++ CPU kernels (kernels/cpu_kernels.py)
        "transformers>=5.21,<5.25",  # 5.21: Gemma 2 attention soft-capped (eager), as the tests' oracle
        "safetensors>=0.8,<0.9",  # transformers 5.21 requires 0.8
        "tokenizers>=0.23.1,<0.24",  # transformers 5.21 requires 0.23.1
        "jinja2>=3.1,<4",  # chat templates (transformers does not require it)
        # GGUF de-quantisation of the default model (transformers' loader needs both).
        "gguf>=0.17,<0.20",
        "accelerate>=1.10,<1.16",
        "numpy>=1.26,<3",
        "tqdm>=4.66,<5",
        "llguidance>=1.9,<2",  # structured output: JSON-schema-constrained decoding (runtime/structured.py)
        # The Beam face.
        "apache-beam>=2.77,<2.78",
        "pyarrow>=14.0.1,<26",  # apache-beam 2.77 requires 14.0.1
        "zstandard>=0.18,<1",  # .zst inputs, read as Beam reads them (batchgen_beam/compressed.py)
        "google-cloud-storage>=2.18.2,<4",
        "google-crc32c>=1.5,<2",
        # Without it Beam's gs:// I/O silently ignores real credentials (anonymous access only).
        "google-auth-httplib2>=0.1.0,<0.3.0",
    ],
    extras_require={
        # Benchmarks: PNG charts.
        "bench": ["matplotlib>=3.8,<4"],
        "test": ["pytest>=8,<10", "pytest-timeout>=2.3.1,<3", "psutil>=5.9,<8", "gcp-storage-emulator>=2026.7.18,<2027",
                 "peft>=0.19,<0.22",  # the oracle of LoRA merging (tests/test_lora.py); 0.19: transformers 5 and Mixtral's router
                 TRITON],  # the Triton kernels' tests run in its interpreter, on CPU
        "cuda": [TRITON],
        # Launching on Dataflow: Beam's Dataflow runner client (its workers' SDK image has it).
        "gcp": ["apache-beam[gcp]>=2.77,<2.78"],
    },
)

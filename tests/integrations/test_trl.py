"""``scaler_core.accelerate.install`` in TRL's ``SFTTrainer``, with ``SFTConfig``'s defaults.

TRL's trainers are the HF ``Trainer``: it builds the ``Accelerator`` (so accelerate's
scaler) in its constructor and prepares in ``train()``, so ``install(trainer)`` goes
between the two. A tiny Llama built from a config, a word-level tokenizer built here
and a few sentences in memory (nothing downloaded) train twice from the same seed,
once with accelerate's scaler (PyTorch's class) and once after ``install``, with what
``SFTConfig`` sets by default (its learning rate, gradient checkpointing, the fused
AdamW and the linear LR schedule of the ``Trainer``, the clip at ``max_grad_norm=1``)
and only what this CPU needs changed (``fp16=True`` in place of the default
``bf16``, ``use_cpu``, a few steps). accelerate runs as on a GPU
(``torch_scripts/accelerate_gpu_path.py``, as in ``test_accelerate.py``): the
forward runs in float16, checked by a hook. The scale starts high (2**17) and grows
every 2 clean steps until float16 overflows by itself (at 2**20), and an inf is
injected into a gradient at two more steps; the scale and the learning rate after
every step, the parameters and the optimizer state must agree to the bit. Then the
run is cut at step 6 by the ``Trainer``'s own checkpoint (``scaler.pt`` holds the
scaler's state) and resumed in a fresh trainer with ``install``: it ends as the
uninterrupted run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")
pytest.importorskip("accelerate", reason="needs accelerate (pip install accelerate)")
pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
pytest.importorskip("datasets", reason="needs datasets (pip install datasets)")
trl = pytest.importorskip("trl", reason="needs TRL (pip install trl)")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402
from common_torch import assert_same_optimizer_state  # noqa: E402

from scaler_core.accelerate import install  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.usefixtures("fresh_accelerate"),
    # SFTConfig's own default (gradient_checkpointing=True) under transformers 5.24:
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
]
STEPS = 12
SAVE_AT = 6
INF_AT = {7, 10}  # injected; step 6 overflows by itself (at 2**20)
KWARGS = {"init_scale": 2.0**17, "growth_interval": 2}
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "and", "then"]


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _dataset() -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    texts = []
    for _ in range(64):
        n = int(torch.randint(4, 12, (1,), generator=g))
        picks = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
        texts.append(" ".join(WORDS[i] for i in picks))
    return Dataset.from_dict({"text": texts})


def _model(vocab_size: int) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _fit(
    as_on_a_gpu: Any,
    output_dir: Path,
    *,
    ours: bool,
    save: bool = False,
    resume: Path | None = None,
) -> dict[str, Any]:
    """One ``SFTTrainer`` run from seed 0: ``SFTConfig``'s defaults, float16 on the CPU."""
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    scales: list[float] = []
    lrs: list[float] = []
    stepped: list[bool] = []
    dtypes: set[torch.dtype] = set()
    step = [0]

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step[0] = state.global_step  # the step about to run, counted from 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            scaler = trainer.accelerator.scaler
            scales.append(scaler.get_scale())
            lrs.append(trainer.lr_scheduler.get_last_lr()[0])
            if isinstance(scaler, GradScaler):  # the optimizer inside the AcceleratedOptimizer
                stepped.append(scaler.stepped(trainer.optimizer.optimizer))

    def inject(grad: torch.Tensor) -> torch.Tensor:
        if step[0] in INF_AT:
            grad = grad.clone()
            grad[0, 0] = math.inf
        return grad

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    tokenizer = _tokenizer()
    model = _model(len(tokenizer))
    model.lm_head.weight.register_hook(inject)
    model.model.layers[0].mlp.register_forward_hook(
        lambda module, inputs, output: dtypes.add(output.dtype)
    )
    args = SFTConfig(
        output_dir=str(output_dir),
        fp16=True,  # SFTConfig's default is bf16; the loss scaler is float16's
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="steps" if save else "no",
        save_steps=SAVE_AT,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=_dataset(),
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    # The Trainer passes accelerate no GradScalerKwargs: as if it had (kwargs_handlers=).
    trainer.accelerator.scaler_handler = GradScalerKwargs(**KWARGS)
    as_on_a_gpu(trainer.accelerator)
    if ours:
        assert install(trainer) is trainer.accelerator.scaler
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return {
        "scaler": trainer.accelerator.scaler,
        "params": [p.detach().clone() for p in model.parameters()],
        "state": trainer.optimizer.state_dict()["state"],
        "scales": scales,
        "lrs": lrs,
        "stepped": stepped,
        "dtypes": dtypes,
        "optimizer": type(trainer.optimizer.optimizer),
        "fused": trainer.optimizer.optimizer.defaults.get("fused"),
        "checkpointing": model.is_activation_checkpointing,
    }


def _assert_same_end(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The parameters and the optimizer state (moments, step counts) to the bit."""
    for p, q in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(p, q)
    assert_same_optimizer_state(ours["state"], theirs["state"])


def _skipped(scales: list[float]) -> list[int]:
    """The skipped steps, read from the scales: each skip is a backoff."""
    scales = [KWARGS["init_scale"], *scales]
    return [step for step in range(len(scales) - 1) if scales[step + 1] < scales[step]]


def test_install_in_sft_trainer_trains_as_accelerates_own_scaler(
    tmp_path: Path, as_on_a_gpu: Any
) -> None:
    """``SFTConfig``'s defaults (activation checkpointing, fused AdamW, the linear LR
    schedule stepped per update, skipped ones too, as with PyTorch's scaler, whose
    ``step`` calls a fused ``step`` on every step): bit for bit, the learning rate of
    every step included."""
    theirs = _fit(as_on_a_gpu, tmp_path / "theirs", ours=False)
    ours = _fit(as_on_a_gpu, tmp_path / "ours", ours=True)
    assert type(theirs["scaler"]) is torch.amp.GradScaler
    assert type(ours["scaler"]) is GradScaler
    assert ours["dtypes"] == theirs["dtypes"] == {torch.float16}  # autocast really ran
    assert ours["checkpointing"]  # SFTConfig's default
    assert theirs["checkpointing"]
    assert ours["optimizer"] is theirs["optimizer"] is torch.optim.AdamW
    assert ours["fused"] is theirs["fused"] is True  # the Trainer's adamw_torch_fused
    assert ours["scales"] == theirs["scales"]
    assert ours["lrs"] == theirs["lrs"]
    assert len(set(ours["lrs"])) == STEPS  # the schedule moved on every update, skips too
    skipped = _skipped(ours["scales"])
    assert set(skipped) >= INF_AT
    assert len(skipped) > len(INF_AT)  # float16 overflowed by itself too (at 2**20)
    assert max(ours["scales"]) > KWARGS["init_scale"]  # it grew
    assert ours["scaler"].state.skipped_steps == len(skipped)
    assert [not ran for ran in ours["stepped"]] == [step in skipped for step in range(STEPS)]
    _assert_same_end(ours, theirs)


def test_resumed_from_the_trainers_checkpoint_ends_as_the_whole_run(
    tmp_path: Path, as_on_a_gpu: Any
) -> None:
    """The ``Trainer``'s own checkpoint at step 6 (``scaler.pt`` among the optimizer's,
    the scheduler's and the RNG states), written by accelerate's scaler or by
    scaler-core's, resumed in a fresh ``SFTTrainer`` after ``install``: the last steps
    and the end are those of the uninterrupted run."""
    theirs = _fit(as_on_a_gpu, tmp_path / "theirs", ours=False, save=True)
    ours = _fit(as_on_a_gpu, tmp_path / "ours", ours=True, save=True)
    assert ours["scales"] == theirs["scales"]
    _assert_same_end(ours, theirs)
    for written_by in ("theirs", "ours"):
        checkpoint = tmp_path / written_by / f"checkpoint-{SAVE_AT}"
        saved = torch.load(checkpoint / "scaler.pt", weights_only=True)
        assert saved["scale"] == theirs["scales"][SAVE_AT - 1]
        resumed = _fit(
            as_on_a_gpu, tmp_path / f"resumed-{written_by}", ours=True, resume=checkpoint
        )
        assert resumed["dtypes"] == {torch.float16}
        assert resumed["scales"] == theirs["scales"][SAVE_AT:]
        assert resumed["lrs"] == theirs["lrs"][SAVE_AT:]
        assert set(_skipped(theirs["scales"])) & set(range(SAVE_AT, STEPS))  # skips after it
        _assert_same_end(resumed, theirs)

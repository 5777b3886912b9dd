"""Compacted-model files are read as hostile input: a fuzz of bit flips, truncations and edited descriptions.

Every mutation (fixed seeds) either loads a model whose outputs equal the compacted
model's, or raises :class:`~prunekit.io.compacted.CompactedModelError` (a ``ValueError``)
whose message starts with the file's path and says why -- never another exception, and
never a partly rebuilt model: on a refusal the fresh model is exactly as it was.
Edited descriptions are sealed again with a valid checksum (what someone who edits the
file on purpose would do), so they reach the checks behind the checksum.
"""

import copy
import hashlib
import io
import random

import pytest
import torch
from torch import nn

from prunekit.compact import compact, compaction_description, load_compacted, prune_groups, save_compacted
from prunekit.io.compacted import CompactedModelError

pytestmark = pytest.mark.usefixtures("one_thread")


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 6), nn.LayerNorm(6)).eval()


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.ff1 = nn.Linear(16, 32)
        self.ff2 = nn.Linear(32, 4)

    def forward(self, ids):
        h = self.emb(ids)
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.ff2(torch.relu(self.ff1(h)))


def _attn():
    torch.manual_seed(0)
    return _Attn().eval()


FAMILIES = {
    "cnn": (_cnn, lambda: torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))),
    "attention": (_attn, lambda: torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    make, inputs = FAMILIES[request.param]
    x = inputs()
    m = make()
    prune_groups(m, x, 0.5)
    small = compact(m, x).eval()
    buf = io.BytesIO()
    save_compacted(small, buf)
    with torch.no_grad():
        ref = small(x)
    return {"make": make, "x": x, "ref": ref, "raw": buf.getvalue(), "sd": small.state_dict(),
            "desc": compaction_description(small)}


def _seal(raw: bytes) -> bytes:
    """A torch.save archive sealed as prunekit does: SHA-256 of all bytes before the zip comment's length."""
    comment = b"prunekit-sha256:" + hashlib.sha256(raw[:-2]).hexdigest().encode()
    return raw[:-2] + len(comment).to_bytes(2, "little") + comment


def _sealed(sd, desc) -> bytes:
    buf = io.BytesIO()
    torch.save({"state_dict": sd, "description": desc}, buf)
    return _seal(buf.getvalue())


def _snapshot(model):
    def attrs(m):
        return {k: v for k, v in vars(m).items() if not k.startswith("_") or k == "_prunekit_compaction"}

    return ([(n, type(m), attrs(m)) for n, m in model.named_modules()],
            [(k, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()])


def _unchanged(a, b):
    return a[0] == b[0] and [k for k, _ in a[1]] == [k for k, _ in b[1]] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a[1], b[1]))


def _outcome(fam, path, data, **kw):
    """"loaded" (outputs equal), "different" (loaded, outputs differ) or "refused" -- checking the contract."""
    path.write_bytes(data)
    fresh = fam["make"]()
    before = _snapshot(fresh)
    try:
        model = load_compacted(fresh, path, **kw)
    except CompactedModelError as e:
        msg = str(e)
        assert msg.startswith(f"{path}: ") and len(msg) > len(f"{path}: ") + 10, msg
        assert _unchanged(_snapshot(fresh), before), f"refused, but the model changed: {msg}"
        return "refused"
    assert model is fresh
    with torch.no_grad():
        out = model.eval()(fam["x"])
    return "loaded" if out.shape == fam["ref"].shape and torch.equal(out, fam["ref"]) else "different"


def test_bit_flips_are_all_refused(family, tmp_path):
    raw = family["raw"]
    rng = random.Random(1234)
    positions = [rng.randrange(len(raw)) for _ in range(40)] + list(range(len(raw) - 102, len(raw)))  # + the seal
    for pos in positions:
        b = bytearray(raw)
        b[pos] ^= 1 << rng.randrange(8)
        assert _outcome(family, tmp_path / "flip.pt", bytes(b)) == "refused", pos


def test_truncations_and_appended_bytes_are_refused(family, tmp_path):
    raw = family["raw"]
    rng = random.Random(99)
    cuts = sorted({1, 2, 80, 82, 101, 102, 103, len(raw) // 2, len(raw) - 1} | {rng.randrange(len(raw)) for _ in range(6)})
    for n in cuts:
        assert _outcome(family, tmp_path / "cut.pt", raw[: len(raw) - n]) == "refused", n
    assert _outcome(family, tmp_path / "long.pt", raw + b"\0") == "refused"
    assert _outcome(family, tmp_path / "empty.pt", b"") == "refused"


def _edits(desc, rng):
    """(label, edited description) pairs: sizes, attributes, names, classes, structure."""
    out = []

    def edit(label, fn):
        d = copy.deepcopy(desc)
        fn(d)
        out.append((label, d))

    names = list(desc["modules"])
    for mname in names:
        entry = desc["modules"][mname]
        for path, shape in entry.get("tensors", {}).items():
            for i, dim in enumerate(shape):
                for new in (dim - 1, dim + 1, 0, 2 * dim, 2 ** 31, dim):
                    def f(d, mname=mname, path=path, i=i, new=new):
                        d["modules"][mname]["tensors"][path][i] = new
                    edit(f"{mname} {path}[{i}]={new}", f)
            edit(f"{mname} {path} rank", lambda d, mname=mname, path=path: d["modules"][mname]["tensors"][path].append(1))
        for attr, value in entry.get("attrs", {}).items():
            news = [value, 0, True, 1.5, str(value), None] + ([value - 1, value + 1] if type(value) is int else [[1]])
            for new in news:
                def g(d, mname=mname, attr=attr, new=new):
                    d["modules"][mname]["attrs"][attr] = new
                edit(f"{mname} {attr}={new!r}", g)
        for attr, value in (("eps", 1000.0), ("momentum", 0.5), ("forward", 1), ("training", True), ("stride", [2, 2]),
                            ("padding", [1, 1]), ("__dict__", 1), ("weight", 1), ("_parameters", 0)):
            edit(f"{mname} +{attr}", lambda d, mname=mname, a=attr, v=value: d["modules"][mname].setdefault(
                "attrs", {}).update({a: v}))
        for key, value in entry.get("init", {}).items():
            for new in ([value + 1, value - 1, 0, 10 ** 9] if type(value) is int else [not value] if type(value) is bool
                        else [0.5, -1.0]):
                def h(d, mname=mname, key=key, new=new):
                    d["modules"][mname]["init"][key] = new
                edit(f"{mname} init {key}={new!r}", h)
        edit(f"{mname} dropped", lambda d, mname=mname: d["modules"].pop(mname))
        edit(f"{mname} renamed", lambda d, mname=mname: d["modules"].update({mname + "x": d["modules"].pop(mname)}))
        edit(f"{mname} class", lambda d, mname=mname: d["modules"][mname].update(
            {"class": "PrunedMultiheadAttention", "init": {"embed_dim": 8, "num_heads": 2, "head_dim": 4}}))
    a, b = rng.sample(names, 2)
    edit(f"swap {a} {b}", lambda d: d["modules"].update({a: d["modules"][b], b: d["modules"][a]}))
    edit("format", lambda d: d.update(format="prunekit.compact/2"))
    edit("modules list", lambda d: d.update(modules=list(d["modules"].values())))
    edit("root entry", lambda d: d["modules"].update({"": {"attrs": {"training": False}}}))
    sample = rng.sample(out, min(len(out), 60))  # a fixed sample: a few dozen per family
    d = copy.deepcopy(desc)
    return sample + [("nothing changed", d)]


def test_edited_descriptions_load_identically_or_are_refused(family, tmp_path):
    rng = random.Random(7)
    seen = {"loaded": 0, "refused": 0}
    for label, desc in _edits(family["desc"], rng):
        try:
            data = _sealed(family["sd"], desc)
        except Exception:  # pragma: no cover - torch.save takes every edit (plain Python values)
            pytest.fail(f"could not write edit {label}")
        got = _outcome(family, tmp_path / "edit.pt", data)
        assert got in seen, f"{label}: {got}"
        seen[got] += 1
    # the unchanged values load; everything else is refused
    assert seen["loaded"] >= 1 and seen["refused"] >= 40, seen


def test_edited_state_dicts_load_identically_or_are_refused(family, tmp_path):
    sd = family["sd"]
    for key in random.Random(11).sample(list(sd), min(len(sd), 6)):
        for label, new in (("dropped", None), ("reshaped", sd[key].reshape(-1)), ("grown", torch.zeros(sd[key].numel() + 1)),
                           ("int", sd[key].to(torch.int64)), ("renamed", sd[key])):
            edited = dict(sd)
            value = edited.pop(key)
            if label == "renamed":
                edited[key + "_"] = value
            elif new is not None:
                edited[key] = new
            got = _outcome(family, tmp_path / "sd.pt", _sealed(edited, family["desc"]))
            # a 1-D tensor reshaped is itself; an integer buffer stays an integer
            ok = {"loaded", "refused"} if label in ("reshaped", "int") else {"refused"}
            assert got in ok, (key, label, got)


def test_unsealed_bit_flips_never_raise_another_exception(family, tmp_path):
    """Without a checksum (``require_checksum=False``), a flip in a tensor's bytes can change outputs -- that is
    what the checksum is for -- but every other flip is still refused cleanly or loads, never half-loads."""
    raw = family["raw"]
    unsealed = raw[: -(2 + 80)] + b"\0\0"  # the archive as torch.save wrote it
    rng = random.Random(4321)
    outcomes = {"loaded": 0, "different": 0, "refused": 0}
    for _ in range(60):
        b = bytearray(unsealed)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        outcomes[_outcome(family, tmp_path / "old.pt", bytes(b), require_checksum=False)] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 60, outcomes

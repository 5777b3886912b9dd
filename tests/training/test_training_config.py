import pytest

from prunekit.training import PrunerConfig, PruningConfig, load_config


def test_defaults():
    c = PrunerConfig()
    assert (c.prune_type, c.target_sparsity, c.pattern, c.prune_domain) == ("snip_momentum", 0.9, "4x1", "global")
    assert (c.start_step, c.end_step, c.sparsity_decay_type, c.update_frequency_on_step) == (0, 0, "exp", 1)
    assert (c.min_sparsity_ratio_per_layer, c.max_sparsity_ratio_per_layer) == (0.0, 0.98)
    assert c.names == [] and c.excluded_names == [] and c.extra_excluded_names == []
    assert c.prune_layer_type == ["Linear", "Conv1d", "Conv2d", "Conv3d"]


def test_aliases_map_to_canonical_keys():
    c = PrunerConfig.from_dict({
        "pruning_type": "magnitude", "pruning_scope": "local", "pruning_frequency": 5,
        "op_names": ["fc"], "excluded_op_names": ["fc2"], "min_sparsity_ratio_per_op": 0.1,
        "max_sparsity_ratio_per_op": 0.95, "pruning_op_types": ["Conv"],
    })
    assert (c.prune_type, c.prune_domain, c.update_frequency_on_step) == ("magnitude", "local", 5)
    assert (c.names, c.excluded_names) == (["fc"], ["fc2"])
    assert (c.min_sparsity_ratio_per_layer, c.max_sparsity_ratio_per_layer) == (0.1, 0.95)
    assert c.layer_type_names == ["Conv1d", "Conv2d", "Conv3d"]


def test_entries_override_globals():
    cfg = PruningConfig.from_dict({
        "prune_type": "magnitude", "target_sparsity": 0.7, "end_step": 10,
        "pruners": [{"names": ["^a"]}, {"names": ["^b"], "target_sparsity": 0.3, "prune_type": "snip"},
                    {"names": ["^c"], "pattern": "1:4"}],
    })
    a, b, c = cfg.pruners
    assert (a.prune_type, a.target_sparsity, a.end_step) == ("magnitude", 0.7, 10)
    assert (b.prune_type, b.target_sparsity, b.end_step) == ("snip", 0.3, 10)
    assert c.target_sparsity == 0.75  # 1:4 keeps one in four


def test_unknown_key_did_you_mean():
    with pytest.raises(ValueError, match=r"pruning config: unknown key 'target_sparsty'\. Did you mean 'target_sparsity'\?"):
        PruningConfig.from_dict({"target_sparsty": 0.5})
    with pytest.raises(ValueError, match=r"pruners\[1\]: unknown key 'excluded_name'\. Did you mean 'excluded_names'\?"):
        PruningConfig.from_dict({"pruners": [{}, {"excluded_name": ["x"]}]})
    with pytest.raises(ValueError, match=r"unknown key 'zzz'\. Known keys"):
        PrunerConfig.from_dict({"zzz": 1})


@pytest.mark.parametrize("d, exc, msg", [
    ({"target_sparsity": "0.9"}, TypeError, r"target_sparsity='0.9' \(str\) must be a number in \[0, 1\]"),
    ({"target_sparsity": 1.5}, ValueError, r"target_sparsity=1.5 is out of range; use a number in \[0, 1\]"),
    ({"start_step": -1}, ValueError, r"start_step=-1 must be an integer >= 0"),
    ({"end_step": 2.5}, TypeError, r"end_step=2.5 \(float\) must be an integer"),
    ({"update_frequency_on_step": 0}, ValueError, r"update_frequency_on_step=0 must be an integer >= 1"),
    ({"start_step": 5, "end_step": 2}, ValueError, r"end_step=2 is before start_step=5"),
    ({"prune_domain": "globl"}, ValueError, r"prune_domain='globl' is not a scope.*Did you mean 'global'\?"),
    ({"sparsity_decay_type": "cubic"}, ValueError, r"sparsity_decay_type='cubic'.*Did you mean 'cube'\?"),
    ({"prune_type": "magnitud"}, ValueError, r"prune_type='magnitud' is not a registered pruner.*Did you mean 'magnitude'\?"),
    ({"pattern": "4y1"}, ValueError, r"pattern='4y1' is not a pattern"),
    ({"pattern": "2:4", "target_sparsity": 0.8}, ValueError, r"target_sparsity=0.8 does not match pattern '2:4'.*set target_sparsity: 0.5"),
    ({"names": "(unclosed"}, ValueError, r"names entry '\(unclosed' is not a valid regular expression"),
    ({"names": [1, 2]}, TypeError, r"names=\[1, 2\] must be a list of strings"),
    ({"min_sparsity_ratio_per_layer": 0.6, "max_sparsity_ratio_per_layer": 0.5}, ValueError, r"min_sparsity_ratio_per_layer=0.6 is above max_sparsity_ratio_per_layer=0.5"),
    ({"target_sparsity": 0.99}, ValueError, r"target_sparsity=0.99 is above max_sparsity_ratio_per_layer=0.98"),
    ({"pruning_type": "snip", "prune_type": "snip"}, ValueError, r"'pruning_type' and 'prune_type' are two spellings of the same key"),
    ({"pruners": []}, TypeError, r"pruners=\[\]; write a non-empty list"),
    ({"prune_layer_type": []}, ValueError, r"prune_layer_type=\[\] selects no layer"),
    ({"start_step": True}, TypeError, r"start_step=True \(bool\) must be an integer"),
])
def test_config_errors_name_key_value_and_fix(d, exc, msg):
    with pytest.raises(exc, match=msg):
        PruningConfig.from_dict(d)


def test_config_errors_are_never_assertions():
    with pytest.raises(ValueError) as info:
        PruningConfig.from_dict({"target_sparsity": 2})
    assert not isinstance(info.value, AssertionError)


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "prune.yaml"
    path.write_text(
        "prune_type: snip_momentum\n"
        "pattern: 1x1\n"
        "end_step: 20\n"
        "pruners:\n"
        "  - op_names: ['conv.*']\n"
        "    target_sparsity: 0.8\n"
        "  - op_names: ['fc']\n"
        "    pattern: '2:4'\n"
    )
    cfg = load_config(str(path))
    assert [p.names for p in cfg.pruners] == [["conv.*"], ["fc"]]
    assert [p.target_sparsity for p in cfg.pruners] == [0.8, 0.5]
    assert PruningConfig.from_dict(cfg.to_dict()) == cfg


def test_load_config_accepts_every_form():
    pc = PrunerConfig(prune_type="magnitude")
    assert load_config(pc).pruners == [pc]
    assert load_config([{"prune_type": "magnitude"}]).pruners == [pc]
    with pytest.raises(TypeError, match="pass a dict, a list of dicts, a YAML path"):
        load_config(3)


@pytest.mark.parametrize("d, exc, msg", [
    ({"target_sparsity": 1.5}, ValueError, r"target_sparsity=1.5 is out of range"),
    ({"pattern": "2:4", "target_sparsity": 0.8}, ValueError, r"target_sparsity=0.8 does not match pattern '2:4'"),
    ({"prune_type": "magnitude", "target_sparsity": 0.9, "max_sparsity_ratio_per_layer": 0.5}, ValueError,
     r"target_sparsity=0.9 is above max_sparsity_ratio_per_layer=0.5"),
])
def test_config_errors_from_prepare_pruning_leave_the_model_untouched(framework, d, exc, msg):
    import prunekit
    from prunekit.training import prepare_pruning

    model = framework.nn.Sequential(framework.nn.Linear(8, 8), framework.nn.ReLU(), framework.nn.Linear(8, 4))
    before = {k: framework.to_torch(v) for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=msg):
        prepare_pruning(model, d)
    assert not prunekit.is_pruned(model)
    after = {k: framework.to_torch(v) for k, v in model.state_dict().items()}
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)


# ---------------------------------------------------------------------- config files through the hostile reader
def test_config_files_are_bounded_strict_and_parsed_by_libyaml(tmp_path):
    from prunekit.io import UnreadableFileError

    bomb = ", ".join(["&a [x, x, x, x, x, x, x, x, x]"] + [
        f"&{c} [" + ", ".join(["*" + p] * 9) + "]" for p, c in zip("abcde", "bcdef")])
    cases = {
        # a valid config, only too large: 1 MiB is the limit for a config
        "big.yaml": ("prune_type: magnitude\nnames: [" + ", ".join(["'^fc$'"] * 150_000) + "]\n",
                     "larger than 1048576 bytes"),
        "bomb.yaml": ("prune_type: magnitude\nnames: [" + bomb + "]\n",
                      "expands to more than 100000 values through aliases"),
        "dup.yaml": ("prune_type: magnitude\ntarget_sparsity: 0.5\ntarget_sparsity: 0.9\n",
                     "not valid YAML (duplicate key 'target_sparsity', line 3); keep one"),
        "dup.json": ('{"prune_type": "magnitude", "target_sparsity": 0.5, "target_sparsity": 0.9}',
                     "not valid JSON (duplicate key 'target_sparsity')"),
        "nan.json": ('{"target_sparsity": NaN}', "not valid JSON (NaN is not JSON)"),
        "self.yaml": ("pruners: &p [{names: *p}]\n", "an alias refers to a value that contains it"),
        "number.yaml": ("start_step: 1" + ":0" * 3000 + "\n", "a number 6001 characters long"),
        "stamp.yaml": ("start_step: 2001-13-01\n", "not valid YAML (month must be in 1..12)"),
        "two.yaml": ("prune_type: magnitude\n---\nprune_type: snip\n", "expected a single document in the stream"),
    }
    for name, (text, match) in cases.items():
        (tmp_path / name).write_text(text)
        for load in (PruningConfig.from_yaml, load_config):
            path = str(tmp_path / name)
            with pytest.raises(UnreadableFileError) as info:
                load(path)
            msg = str(info.value)
            assert msg.startswith(path + ": ") and match in msg and len(msg) < 300, (name, msg[:300])
    assert len((tmp_path / "bomb.yaml").read_text()) < 300
    # a valid JSON config reads the same as its YAML
    (tmp_path / "ok.json").write_text('{"prune_type": "magnitude", "target_sparsity": 0.5, "names": ["fc"]}')
    (tmp_path / "ok.yaml").write_text("prune_type: magnitude\ntarget_sparsity: 0.5\nnames: [fc]\n")
    assert PruningConfig.from_yaml(str(tmp_path / "ok.json")) == load_config(str(tmp_path / "ok.yaml"))


def test_config_yaml_is_parsed_by_libyaml_when_pyyaml_has_it():
    yaml = pytest.importorskip("yaml")
    from prunekit.io.reader import _yaml_loader

    if not yaml.__with_libyaml__:
        pytest.skip("this pyyaml is built without libyaml")
    assert issubclass(_yaml_loader(()), yaml.CSafeLoader)


def test_config_errors_quote_values_short():
    with pytest.raises(TypeError) as info:
        PruningConfig.from_dict({"names": [[str(i)] for i in range(100_000)]})
    msg = str(info.value)
    assert msg.startswith("pruning config: names=[['0'], ['1'], ") and "...]" in msg and len(msg) < 300

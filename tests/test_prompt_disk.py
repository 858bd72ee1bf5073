"""The prefix cache's disk tier (``--prompt-cache-dir``, ``mlxcluster/engine/prompt_disk.py``): K/V
written by one engine is taken by a fresh one over the same directory and decodes what a cold
prefill decodes; files of another identity, corrupt or truncated ones are refused, never loaded; the
size bound deletes the least recently used; short prompts are not written.  In-process, tiny model."""

import dataclasses
import json
import os
import shutil

import pytest

mx = pytest.importorskip("mlx.core")

import tinymodel  # noqa: E402
from mlxcluster.engine.decode import RankEngine  # noqa: E402
from mlxcluster.engine.kv_sources import Compute  # noqa: E402
from mlxcluster.engine.sampling import Sampling  # noqa: E402
from mlxcluster.engine import prompt_disk  # noqa: E402
from mlxcluster.engine.prompt_disk import DiskPrompts, Identity, parse_size  # noqa: E402

CONTEXT = 1024
MIN = 32  # the tests' disk minimum (the default, MIN_TOKENS, is tested apart)
C = tinymodel.TINY_CONFIG


def identity(**kw) -> Identity:
    base = dict(model_digest="sha256:tiny0", weights="float32", rank=0, world_size=1, topology="",
                n_layers=C["num_hidden_layers"], n_kv_heads=C["num_key_value_heads"], head_dim=C["head_dim"],
                kv_dtype="float32")
    return Identity(**{**base, **kw})


def prompt(n: int, seed: int = 0) -> list:
    return [(7 * i + 13 * seed + 1) % C["vocab_size"] for i in range(n)]


def engine(model, disk=None):
    eng = RankEngine(model, CONTEXT)
    if disk is not None:
        assert eng.attach_disk(disk)
    return eng


def run(eng, uid, ids, n=8, cached=None):
    """Greedy tokens of ``ids`` (its prefix-cache match taken, unless ``cached``), then removed."""
    cached = eng.prefix_match(ids) if cached is None else cached
    out = [eng.prefill(uid, ids, Sampling(), (), 100, cached)]
    for _ in range(n - 1):
        out += eng.step()
    eng.remove(uid)
    return out


def files(disk):
    return sorted(n for n in os.listdir(disk.dir) if n.endswith(".safetensors"))


def test_a_fresh_engine_takes_the_prefix_from_disk_and_decodes_as_a_cold_prefill(model, tmp_path):
    base = prompt(80)
    first = DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN)
    run(engine(model, first), "a", base)
    assert first.written == 1 and len(files(first)) == 1
    later = base[:70] + prompt(12, seed=5)  # shares 70 positions
    cold = run(engine(model), "cold", later)

    # a new process: a fresh engine and disk tier over the same directory (headers only read)
    disk = DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN)
    assert disk.keys() == [tuple(base[:-1])] and disk.loads == 0
    eng = engine(model, disk)
    assert eng.prefix_match(later) == 70
    assert run(eng, "b", later) == cold
    p = eng.prefix
    assert (p.disk_hit_positions, p.memory_hit_positions, disk.loads) == (70, 0, 1)
    # promoted: the next prompt sharing it is a memory hit
    third = base[:75] + prompt(6, seed=9)
    assert run(eng, "c", third) == run(engine(model), "cold3", third)
    assert (p.disk_hit_positions, p.memory_hit_positions, disk.loads) == (70, 75, 1)


@pytest.mark.parametrize("field,value", [("model_digest", "sha256:other"), ("rank", 1), ("world_size", 2),
                                         ("topology", "--layers 0:0,1:output"), ("kv_dtype", "bfloat16"),
                                         ("n_kv_heads", 1), ("weights", "quantized")])
def test_a_file_of_another_identity_is_refused_never_loaded_nor_deleted(model, tmp_path, monkeypatch, field, value):
    base = prompt(60)
    other = DiskPrompts(str(tmp_path / "a"), 2**30, identity(**{field: value}), min_tokens=MIN)
    other.save(tuple(base[:-1]), _kv(other.identity, len(base) - 1))
    mine = identity()
    own = tmp_path / "b" / mine.key()
    own.mkdir(parents=True)
    name = files(other)[0]
    shutil.copy(os.path.join(other.dir, name), own / name)  # in this rank's own directory, even
    loads = []
    monkeypatch.setattr(prompt_disk.mx, "load", lambda *a, **k: loads.append(a) or mx.load(*a, **k))
    disk = DiskPrompts(str(tmp_path / "b"), 2**30, mine, min_tokens=MIN)
    assert disk.refused == 1 and disk.keys() == [] and loads == []
    assert (own / name).exists()  # another identity's file is never deleted
    assert engine(model, disk).prefix_match(base) == 0


def _kv(ident, n, dtype=mx.float32):
    return [(mx.random.normal((1, ident.n_kv_heads, n, ident.head_dim)).astype(dtype),
             mx.random.normal((1, ident.n_kv_heads, n, ident.head_dim)).astype(dtype))
            for _ in range(ident.n_layers)]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_a_corrupt_or_truncated_file_is_refused_and_deleted(model, tmp_path, monkeypatch, damage):
    base = prompt(60)
    first = DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN)
    run(engine(model, first), "a", base)
    path = os.path.join(first.dir, files(first)[0])
    raw = open(path, "rb").read()
    if damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "garbage":
        raw = b"\xff" * 64
    else:  # a header length past the end of the file
        raw = (len(raw) * 2).to_bytes(8, "little") + raw[8:]
    open(path, "wb").write(raw)
    loads = []
    monkeypatch.setattr(prompt_disk.mx, "load", lambda *a, **k: loads.append(a) or mx.load(*a, **k))
    disk = DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN)
    assert disk.refused == 1 and disk.keys() == [] and loads == []
    assert not os.path.exists(path)  # corrupt and in this rank's own directory


def test_a_file_damaged_after_start_is_refused_at_load_and_the_prompt_prefilled(model, tmp_path):
    """The index said it is there (match), the file no longer reads (take): the prompt is prefilled
    whole and decodes as a cold run."""
    base = prompt(60)
    run(engine(model, DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN)), "a", base)
    disk = DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN)
    path = os.path.join(disk.dir, files(disk)[0])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    later = base[:50] + prompt(10, seed=3)
    cold = run(engine(model), "cold", later)
    eng = engine(model, disk)
    assert eng.prefix_match(later) == 50
    assert run(eng, "b", later) == cold
    assert disk.refused == 1 and disk.loads == 0 and eng.prefix.disk_hit_positions == 0
    assert not os.path.exists(path)


def test_the_size_bound_deletes_the_least_recently_used(model, tmp_path):
    ident = identity()
    a, b, c = (tuple(prompt(60, seed=s)[:-1]) for s in (1, 2, 3))
    one = 8 + 2 * ident.n_layers * ident.n_kv_heads * 59 * ident.head_dim * 4  # tensors, without the header
    disk = DiskPrompts(str(tmp_path), int(2.5 * (one + 4096)), ident, min_tokens=MIN)
    disk.save(a, _kv(ident, 59))
    disk.save(b, _kv(ident, 59))
    assert disk.load(a) is not None  # a used after b: b is the least recently used
    disk.save(c, _kv(ident, 59))
    assert disk.keys() == [a, c] and disk.evicted == 1 and len(files(disk)) == 2
    assert disk.bytes <= disk.max_bytes
    # the order is kept in the index (not the files' times): a new process evicts in the same order
    assert disk.load(a) is not None  # a, written before c, used after it
    order = json.load(open(os.path.join(disk.dir, "index.json")))["lru"]
    assert [disk.entries[k][0] for k in (c, a)] == order
    again = DiskPrompts(str(tmp_path), disk.max_bytes, ident, min_tokens=MIN)
    assert again.keys() == [c, a]
    again.save(b, _kv(ident, 59))
    assert again.keys() == [a, b]


def test_short_prompts_are_not_written(model, tmp_path):
    assert prompt_disk.MIN_TOKENS == 256
    disk = DiskPrompts(str(tmp_path), 2**30, identity())
    eng = engine(model, disk)
    run(eng, "short", prompt(200), n=1)
    assert files(disk) == [] and len(eng.prefix) == 1  # the memory tier holds it
    run(eng, "long", prompt(300, seed=1), n=1)
    assert len(files(disk)) == 1 and disk.keys() == [tuple(prompt(300, seed=1)[:-1])]


def test_a_writer_that_is_busy_drops_the_write(model, tmp_path):
    disk = DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN, submit=lambda write: False)
    run(engine(model, disk), "a", prompt(60))
    assert disk.dropped == 1 and files(disk) == []


def test_sizes():
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("800MB") == 800 * 10**6 and parse_size("1000") == 1000
    for bad in ("", "-1", "4 gigs", "0", "GiB"):
        with pytest.raises(ValueError, match="--prompt-cache-size"):
            parse_size(bad)


def test_cli_refuses_bad_options_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from mlxcluster.cli import app

    def exit_of(*args):
        result = CliRunner().invoke(app, ["generate", "hi", *args])
        return result.exit_code, (result.output or "").strip().splitlines()

    code, lines = exit_of("--prompt-cache-dir", str(tmp_path), "--prompt-cache-size", "lots")
    assert code == 2 and len(lines) == 1 and "--prompt-cache-size" in lines[0]
    code, lines = exit_of("--prompt-cache-dir", str(tmp_path), "-n", "2", "--afd", "1:1")
    assert code == 2 and len(lines) == 1 and "--afd" in lines[0], lines
    blocked = tmp_path / "file"
    blocked.write_text("")
    code, lines = exit_of("--prompt-cache-dir", str(blocked / "sub"))
    assert code == 2 and len(lines) == 1 and "--prompt-cache-dir" in lines[0]


@pytest.mark.slow
def test_generate_at_tp3_takes_the_prompt_from_every_ranks_disk(real_model_path, tmp_path):
    """``generate -n 3`` (TP=3) three times over one --prompt-cache-dir: the first writes each rank's
    shard of the ~300-token prompt's K/V (over the disk tier's minimum); before the second, rank 2's file is deleted: the group's
    agreement (an all_min over the ranks) takes nothing from disk and prefills; the third finds the
    prompt on every rank's disk again (rank 2 wrote it back) and takes it.  Every answer is the first's."""
    import glob
    import subprocess
    import sys

    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(26))  # > MIN_TOKENS
    cmd = [sys.executable, "-m", "mlxcluster", "generate", text, "--model", real_model_path, "--max-tokens", "8",
           "--json", "--prompt-cache-dir", str(tmp_path), "-n", "3"]

    def generate():
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def rank_files(rank):
        return [f for f in glob.glob(str(tmp_path / "*" / "*.safetensors"))
                if prompt_disk.read_header(f)[0].get("rank") == str(rank)]

    runs = [generate()]
    assert len(runs[0]["prompt_ids"]) > prompt_disk.MIN_TOKENS and runs[0].get("cached_prompt_tokens", 0) == 0
    assert all(len(rank_files(r)) == 1 for r in range(3))
    os.remove(rank_files(2)[0])
    runs.append(generate())
    assert runs[1].get("cached_prompt_tokens", 0) == 0  # rank 2 held none: the group took none
    assert len(rank_files(2)) == 1  # ... and wrote it back
    runs.append(generate())
    assert runs[2]["cached_prompt_tokens"] == len(runs[0]["prompt_ids"]) - 1
    assert runs[1]["token_ids"] == runs[2]["token_ids"] == runs[0]["token_ids"]


def test_in_a_group_a_disk_join_takes_what_every_rank_holds(model, tmp_path):
    """A group of several ranks (PrefixCache.agree set): a join whose positions rank 0 found on disk
    takes the fewest any rank holds (here a fake all_min: another rank holds 40) and prefills the
    rest, decoding as a cold prefill; the disk prompt is not held in memory (it would be on some ranks
    only), and a join not from disk takes memory only."""
    base = prompt(80)
    run(engine(model, DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN)), "a", base)
    ids = base + [5]
    cold = run(engine(model), "cold", ids, cached=0)
    eng = RankEngine(model, CONTEXT)
    agreed = []
    assert eng.attach_disk(DiskPrompts(str(tmp_path), 2**30, identity(), min_tokens=MIN),
                           agree=lambda n: agreed.append(n) or min(n, 40))
    assert eng.prefix_lookup(ids) == (79, True)  # all but the held prompt's last position
    with pytest.raises(KeyError):
        eng.prefix.take(ids, 79)  # not from disk: in a group, memory only (the memory tiers are in step)
    assert agreed == [] and len(eng.prefix) == 0
    eng.admit("b", ids, Sampling(), (), 100, Compute(79, "", True))
    assert agreed == [79] and eng.get("b").session.position == 40 and len(eng.prefix) == 0
    out = eng.prefill_admitted(["b"])
    for _ in range(7):
        out += eng.step()
    assert out == cold


def test_a_join_nodes_directory_reaches_its_ranks_as_a_soft_default(tmp_path):
    """``join --prompt-cache-dir`` reaches the node's MPI ranks in the environment (MPI gives every rank
    rank 0's command line; its other ranks get it in their RankConfig, ``prompt_cache_node``): a rank
    without its own directory takes it as a default, and where the formation's
    topology keeps no disk tier it goes without one (a warning) instead of failing the formation, while
    the same refusal of an explicit option is an error."""
    from types import SimpleNamespace

    from mlxcluster.config import Config
    from mlxcluster.model.topology import Topology
    from mlxcluster.runtime import rank
    from mlxcluster.runtime.rank_config import RankConfig

    cfg = Config(prompt_cache_dir=str(tmp_path), prompt_cache_size="1GiB")
    base = RankConfig(world_size=2, ports=(1, 2))
    node = rank._resolved(base, cfg)
    assert node.prompt_cache_node and (node.prompt_cache_dir, node.prompt_cache_size) == (str(tmp_path), "1GiB")
    explicit = rank._resolved(dataclasses.replace(base, prompt_cache_dir=str(tmp_path / "own")), cfg)
    assert not explicit.prompt_cache_node and explicit.prompt_cache_dir == str(tmp_path / "own")
    assert not rank._resolved(base, Config()).prompt_cache_dir
    group, local_decode = SimpleNamespace(size=lambda: 2), Topology(layers="15:output,0:14", local_decode=True)
    assert rank._prompt_cache(node, group, None, None, "float32", local_decode) is None
    with pytest.raises(ValueError, match="--local-decode"):
        rank._prompt_cache(explicit, group, None, None, "float32", local_decode)

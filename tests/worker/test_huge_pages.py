"""Weights and KV pools on transparent huge pages: the kernel's setting read, buffers
aligned, zeroed and marked, KV pools backed on a thread without disturbing what steps
write, every tensor of a model moved with ties kept and outputs unchanged, the engine's
tokens those of transformers either way."""
from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.registry import read_arch_config
from kvserve.model.loader import load_model
from kvserve.worker import huge_pages
from kvserve.worker.huge_pages import HUGE_PAGE, HugePageBuffer, PoolPages, huge_page_zeros, \
    huge_pages_available, huge_pages_setting, move_to_huge_pages
from kvserve.worker.platform import allowed_cpus
from tests.helpers import hf_greedy, prompts_of_lengths

needs_thp = pytest.mark.skipif(
    not huge_pages_available(),
    reason=f"the kernel offers no transparent huge pages here ({huge_pages_setting()})")


@pytest.mark.parametrize("text, expected", [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
])
def test_setting_is_the_bracketed_word(tmp_path, monkeypatch, text, expected):
    path = tmp_path / "enabled"
    path.write_text(text)
    monkeypatch.setattr(huge_pages, "THP_SETTING", path)
    assert huge_pages_setting() == expected
    assert huge_pages_available() == (expected != "never")


def test_no_setting_file_means_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert huge_pages_setting() == "unavailable"
    assert not huge_pages_available()


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_buffer_hands_out_aligned_zeroed_tensors():
    buf = HugePageBuffer(3 * 2**20)
    a = buf.take((1000,), torch.float32)
    b = buf.take((3, 5), torch.bfloat16)
    c = buf.take((7,), torch.int64)
    assert a.data_ptr() % HUGE_PAGE == 0  # the first starts on a huge page
    assert b.data_ptr() % 64 == 0 and c.data_ptr() % 64 == 0
    assert b.data_ptr() >= a.data_ptr() + 4000 and c.data_ptr() >= b.data_ptr() + 30
    assert all(int(t.count_nonzero()) == 0 for t in (a, b, c))
    a.fill_(2.0)  # writable, and the others untouched
    assert int(b.count_nonzero()) == 0 and float(a.sum()) == 2000.0


def test_buffer_refuses_a_tensor_past_its_end():
    buf = HugePageBuffer(4096)
    buf.take((512,), torch.float32)
    with pytest.raises(ValueError, match=r"has 2048 bytes left; a \(600,\) torch.float32 "
                                         r"tensor needs 2400"):
        buf.take((600,), torch.float32)


@needs_thp
def test_buffers_are_marked_for_huge_pages():
    t = huge_page_zeros((HUGE_PAGE // 4 + 5,), torch.float32)
    assert t.shape == (HUGE_PAGE // 4 + 5,) and int(t.count_nonzero()) == 0
    smaps = _smaps_entry(t.data_ptr())
    assert smaps.get("THPeligible") == "1", smaps
    if huge_pages_setting() == "madvise":  # a mapping of the same kind, left unmarked, is not
        # (not torch's own allocation: in a long process it may sit in a mapping that
        # something else marked)
        plain = mmap.mmap(-1, 3 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = torch.frombuffer(plain, dtype=torch.uint8).data_ptr()
        assert _smaps_entry(address).get("THPeligible") == "0"


def _resident_bytes(tensor: torch.Tensor) -> int:
    return 1024 * int(_smaps_entry(tensor.data_ptr())["Rss"].split()[0])


def test_pool_pages_are_backed_on_a_thread_around_what_steps_write():
    pages = PoolPages()
    nbytes = 48 * 2**20
    pool = pages.zeros((nbytes // 4,), torch.float32)
    assert int(pool.count_nonzero()) == 0
    pool[:1000] = 3.0  # a step's writes, before and while the thread backs the pool
    pages.start()
    pool[-1000:] = 4.0
    pages.wait()
    assert _resident_bytes(pool) >= nbytes
    assert float(pool[:1000].sum()) == 3000.0 and float(pool[-1000:].sum()) == 4000.0
    assert int(pool.count_nonzero()) == 2000
    pages.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU masks on this OS")
def test_pool_pages_thread_is_not_bound_where_the_compute_thread_is():
    pages = PoolPages()
    pool = pages.zeros((16 * 2**20 // 4,), torch.float32)
    if not pages._ranges:  # a kernel without MADV_POPULATE_WRITE: backed at once, no thread
        assert _resident_bytes(pool) >= 16 * 2**20
        return
    masks = {}
    populate = pages._populate

    def recorded():
        populate()
        masks["pages"] = os.sched_getaffinity(0)

    def bound_starter():  # as the compute thread, bound to one CPU, starts it
        os.sched_setaffinity(0, {min(allowed_cpus())})
        pages._populate = recorded
        pages.start()

    starter = threading.Thread(target=bound_starter)
    starter.start()
    starter.join()
    pages.wait()
    assert masks["pages"] == set(allowed_cpus())


def test_closing_pool_pages_stops_and_joins_the_thread():
    pages = PoolPages()
    pages.zeros((256 * 2**20 // 4,), torch.float32)
    pages.start()
    thread = pages._thread
    pages.close()
    assert thread is None or not thread.is_alive()


def _all_tensors(model):
    return [t for m in model.modules() for t in [*m._parameters.values(), *m._buffers.values()]
            if t is not None]


def test_moving_keeps_the_model_and_its_ties(model_dirs):
    model_dir = model_dirs("llama3-tied")
    model = load_model(model_dir, read_arch_config(Path(model_dir)), torch.float32)
    head = model.lm_head.weight
    assert head is model.model.embed_tokens.weight
    before = [t.clone() for t in _all_tensors(model)]
    moved = move_to_huge_pages(model)
    after = _all_tensors(model)
    assert moved == sum(t.numel() * t.element_size()
                        for t in {t.data_ptr(): t for t in after}.values())
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    buffer = model._huge_page_buffer
    lo = buffer._bytes.data_ptr()
    assert all(lo <= t.data_ptr() < lo + buffer._bytes.numel() for t in after)
    assert model.lm_head.weight is head is model.model.embed_tokens.weight
    assert move_to_huge_pages(model) == 0  # already there: nothing copied again


def test_a_buffer_two_modules_hold_is_moved_once_for_both(model_dirs, tmp_path):
    """A tied head over 16-bit rows holds the token embedding's buffer (not a Parameter):
    both hold the one copy afterwards, the old memory let go."""
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(model_dirs("llama3-tied"), dtype=torch.bfloat16
                                         ).save_pretrained(tmp_path)
    model = load_model(tmp_path, read_arch_config(tmp_path), torch.float32, weights_16bit=True)
    rows = model.model.embed_tokens.gguf_blocks
    assert model.lm_head.gguf_part0 is rows
    move_to_huge_pages(model)
    assert model.lm_head.gguf_part0 is model.model.embed_tokens.gguf_blocks
    assert model.lm_head.gguf_part0.data_ptr() != rows.data_ptr()


def test_no_huge_pages_keeps_torch_allocations(llama_dir):
    worker = LLM(llama_dir, huge_pages=False, num_threads=1).engine.worker
    assert not worker.huge_pages
    assert getattr(worker.model, "_huge_page_buffer", None) is None


@needs_thp
def test_engine_places_weights_and_pools(llama_dir):
    engine = LLM(llama_dir, num_threads=1).engine
    worker = engine.worker
    assert worker.huge_pages
    buffer = worker.model._huge_page_buffer
    lo = buffer._bytes.data_ptr()
    hi = lo + buffer._bytes.numel()
    assert lo <= worker.model.model.embed_tokens.weight.data_ptr() < hi
    # the linear layers' panels: a huge-page buffer of their own (their dense weights,
    # off the model's buffer, were let go: tests/worker/test_panel_gemm.py)
    lm_head = worker.model.lm_head
    assert lm_head.weight.is_meta
    assert _smaps_entry(lm_head.method.panel_weight.data_ptr()).get("THPeligible") == "1"
    engine.settle()  # the pools backed once start-up's background work is done
    for cache in worker.runner.caches:
        for pool in (cache.k, cache.v):
            assert pool.data_ptr() % HUGE_PAGE == 0
            assert _smaps_entry(pool.data_ptr()).get("THPeligible") == "1"
            assert _resident_bytes(pool) >= pool.numel() * pool.element_size()
    thread = worker.pool_pages._thread
    worker.close()
    assert thread is None or not thread.is_alive()


@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "no-huge-pages"])
def test_greedy_tokens_equal_transformers(llama_dir, huge):
    prompts = prompts_of_lengths([3, 17, 40])
    llm = LLM(llama_dir, huge_pages=huge, max_num_seqs=3)
    assert llm.engine.worker.huge_pages == (huge and huge_pages_available())
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(llama_dir, prompts, 12)

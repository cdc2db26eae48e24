"""SparseCore's 64-row partial paths (TP 1, TP 2; DCP 4 at TP 8): two warpgroups of wgmma.

The operands are in shared memory in the no-swizzle canonical layout; P @ V at m64n256k16
(each warpgroup 256 of the 512 latent dims).

partial_wgmma_ws  two consumer warpgroups and a third, the producer, that loads (and
                  dequantizes) the blocks behind full / empty mbarriers (384 threads,
                  setmaxnreg). Past RESHAPE_BLOCKS blocks a CTA each consumer warpgroup scores
                  half of every block (m64n(block / 2)k16); up to it they take FlashMLA's
                  shape: warpgroup 0 scores whole blocks (m64n(block)k16) and does P @ V on
                  dims 0 .. 255 with P from registers, warpgroup 1 dims 256 .. 511. (The kernel
                  without the producer, every thread loading, was slower over fp8 and tied
                  over bf16: removed in session 46, docs/levers.md Part X.)
crossover         CROSSOVER: a token's two 64-row CTAs (head groups 2 i,
                  2 i + 1) of a split launch as a cluster of 2; each producer loads half of
                  every block's rows (XOVER_ROWS) into its own tile and, by st.async completing
                  on the peer's full mbarrier, into the peer's, so each SM moves and
                  dequantizes half the rows (produce_blocks has the protocol); FlashMLA's
                  consumer shape at every block count. A cluster launch puts the CTA's rank in
                  its shared addresses' high bits, so every wgmma descriptor masks the address
                  to its 18-bit field (primitives.smem_desc_lines). Without a partner
                  (q_heads / 64 odd) or under 64-slot blocks: partial_wgmma_ws.

`SparseCore` (kernels/sparse_core.py) takes these methods as a mixin and picks the path (its
knobs, CROSSOVER and RESHAPE_BLOCKS, are its module's); what
bounds them and why each default is what it is: docs/levers.md Part S.5-S.8.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8

from . import guards
from . import primitives as P
from .sparse_core_layout import CONSUMER_BAR, K_STEPS, LATENT, LOG2E, ROW

# 64-row CTAs (wgmma): shared operands in the no-swizzle canonical layout, 16-byte chunks of
# 8 dims; chunk c of row r at c x CHUNK + r x 16 (64 rows: 8-row core matrices 128 B apart)
WG_ROWS, WG_THREADS = 64, 256  # two consumer warpgroups
CHUNK = WG_ROWS * 16  # bytes between k chunks (the K-major LBO)
TILE_BYTES = (ROW // 8) * CHUNK  # 64 rows x 576 dims as bf16: the query rows, or a block of cache rows
TILE_CHUNKS = ROW // 8  # 72
# partial_wgmma_ws: a producer warpgroup beside the two consumer warpgroups, the 3 x 168
# registers ptxas gives 384 threads re-dealt by setmaxnreg as 2 x CONSUMER_REGS +
# PRODUCER_REGS, or in FlashMLA's consumer shape (SparseCore.reshape) as scorer / values /
# producer
WS_THREADS = 3 * 128
CONSUMER_REGS, PRODUCER_REGS = 184, 136
SCORER_REGS, VALUES_REGS, RESHAPE_PRODUCER_REGS = 200, 160, 144
VALUES_RS_REGS = (200, 176, 128)  # sparse_core.VALUES_RS: P's 16 words held through the P @ V
LAUNCH_REGS = 168  # what ptxas gives each of the 384 threads; setmaxnreg re-deals that pool
P_READY, P_FREE = 2, 3  # named barriers (256 threads): P and the factors written / read
XOVER_ROWS = WG_ROWS // 2  # the rows of a block each CTA of the pair loads
XOVER_BYTES = XOVER_ROWS * TILE_CHUNKS * 16  # what one producer pushes into the peer a block: 36,864
# The trace probe (sparse_core.PROBE = "trace": the crossover at one split, B = 64 at TP 1;
# bench_sparse_core.py --trace): one thread of each role stores its %clock at each step of each
# block into int32 words of its CTA's first partial_o row (unused at one split), TRACE_BLOCKS
# blocks at most: the scorer (thread 0) at TRACE_SCORER + 4 b + (full waited, scores done, P
# handed over, its P @ V done), the values warpgroup (thread 128) at TRACE_VALUES + 3 b + (P
# ready, rescaled and about to issue its P @ V, its P @ V done), the producer (thread 256) at
# TRACE_PRODUCER + 3 b + (loads issued, buffer empty, rows stored), thread 0's kernel entry at
# TRACE_START.
TRACE_BLOCKS = 32
TRACE_SCORER, TRACE_VALUES, TRACE_PRODUCER = 0, 4 * TRACE_BLOCKS, 7 * TRACE_BLOCKS
TRACE_START = 10 * TRACE_BLOCKS
TRACE_WORDS = TRACE_START + 1


def producer_map(ptid, v, block: int) -> tuple:
    """(row r of the block, first chunk group cg0, quarter q4) of partial_wgmma_ws's producer
    thread ptid (0 .. 127), share v (0 or 1: the thread does the work of two, virtual threads
    ptid and ptid + 128 of 256): its 16-byte chunks 4 (cg0 + step j) + q4 of row r, step = 8 / (block / 8).
    At 64-slot blocks share v is rows 32 v .. 32 v + 31: the crossover's CTA rank v loads
    that share alone. (Python ints on the host, the kernel's Int32 on the device.)"""
    groups = block // 8
    vwarp, vlane = ptid // 32 + 4 * v, ptid % 32
    return 8 * (vwarp % groups) + vlane % 8, vwarp // groups, vlane // 8


# Descriptor bits besides the start address (PTX ISA, "Matrix Descriptor"; no swizzle):
# K-major ((8, m), (T, 2k)) : ((T, SBO), (1, LBO)): SBO between 8-row groups, LBO between
# k chunks. MN-major ((T, 1, m), (8, k)) : ((1, T, SBO), (T, LBO)): SBO between 8-element
# groups along N, LBO between 8-row groups along K.
DESC_K = (128 >> 4) << 32 | (CHUNK >> 4) << 16  # Q, K and P: 8-row groups 128 B apart, k chunks CHUNK
DESC_V = (CHUNK >> 4) << 32 | (128 >> 4) << 16  # V (MN-major): 8-dim groups CHUNK apart, 8-slot groups 128 B


def wgmma_scores(q_addr, k_addr, n: int, b_layout: int = DESC_K, b_chunk: int = CHUNK) -> list:
    """S[64 rows, n slots] = Q (shared, K-major) x K^T (shared rows, K-major B), bf16, FP32
    accumulation over the 36 k steps of 16 dims; issued, committed and waited for in one
    asm block. Thread (warp w of the warpgroup, g, t) gets s[4 j + 2 r + e] = row 16 w + g
    + 8 r, slot 8 j + 2 t + e. B's descriptor bits b_layout, its k chunks b_chunk bytes
    apart (the transposed path: A the block's rows, B its 16 query rows)."""
    d = ", ".join(f"{{$w{i}}}" for i in range(n // 2))
    lines = ["{", ".reg .b64 a0, b0, a, b;", ".reg .pred first, more;"]
    lines += P.smem_desc_lines("a0", "{$r0}", DESC_K) + P.smem_desc_lines("b0", "{$r1}", b_layout)
    lines += ["setp.ne.b32 first, 0, 0;", "setp.eq.b32 more, 0, 0;", "wgmma.fence.sync.aligned;"]
    for s in range(K_STEPS):
        lines.append(f"add.s64 a, a0, {2 * CHUNK * s >> 4};")
        lines.append(f"add.s64 b, b0, {2 * b_chunk * s >> 4};")
        lines.append(
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, a, b, "
            f"{'first' if s == 0 else 'more'}, 1, 1, 0, 0;"
        )
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return list(
        cute.arch.inline_ptx("\n\t".join(lines), write_only_types=[Float32] * (n // 2), read_only_args=[q_addr, k_addr])
    )


def wgmma_values(acc, p_addr, v_addr, k_steps: int) -> list:
    """O[64 rows, 256 dims] += P (shared bf16, K-major: rows x slots) x V (the same shared
    cache rows read MN-major: slots x dims, transposed B), k_steps steps of 16 slots.
    acc: 128 FP32 in the accumulator layout (acc[4 j + 2 r + e]: row 16 w + g + 8 r, dim
    8 j + 2 t + e); returned updated."""
    count = len(acc)
    d = ", ".join(f"{{$w{i}}}" for i in range(count))
    lines = ["{", ".reg .b64 a0, b0, a, b;", ".reg .pred more;"]
    lines += P.smem_desc_lines("a0", f"{{$r{count}}}", DESC_K) + P.smem_desc_lines("b0", f"{{$r{count + 1}}}", DESC_V)
    lines += ["setp.eq.b32 more, 0, 0;"]
    lines += [f"mov.f32 {{$w{i}}}, {{$r{i}}};" for i in range(count)]
    lines += ["wgmma.fence.sync.aligned;"]
    for s in range(k_steps):
        lines.append(f"add.s64 a, a0, {2 * CHUNK * s >> 4};")
        lines.append(f"add.s64 b, b0, {16 * 16 * s >> 4};")
        lines.append(f"wgmma.mma_async.sync.aligned.m64n{2 * count}k16.f32.bf16.bf16 {{{d}}}, a, b, more, 1, 1, 0, 1;")
    lines += ["wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;", "}"]
    return list(
        cute.arch.inline_ptx(
            "\n\t".join(lines), write_only_types=[Float32] * count, read_only_args=list(acc) + [p_addr, v_addr]
        )
    )


def store_row_sum(address, total):
    """finish_wgmma: a warpgroup's row sum into shared memory. A helper of its own (and
    load_row_sum) so that scripts/sanitize_known.txt's entry names these accesses alone."""
    cute.arch.inline_ptx("st.shared.f32 [{$r0}], {$r1};", read_only_args=[address, total])


def load_row_sum(address) -> Float32:
    """finish_wgmma: a warpgroup's row sum back from shared memory (see store_row_sum)."""
    return cute.arch.inline_ptx("ld.shared.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[address])


def store_factor(address, factor):
    """score_block: a row's rescale factor into shared memory for the values warpgroup. A
    helper of its own (and load_factor) so that scripts/sanitize_known.txt's entry names these
    accesses alone (the P_READY / P_FREE handoff, racecheck under a cluster launch with
    setmaxnreg, as the row sums')."""
    cute.arch.inline_ptx("st.shared.f32 [{$r0}], {$r1};", read_only_args=[address, factor])


def load_factor(address) -> Float32:
    """values_block_half: a row's rescale factor from shared memory (see store_factor)."""
    return cute.arch.inline_ptx("ld.shared.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[address])


class WgmmaPaths:
    """partial_wgmma_ws (with or without the crossover) and what it calls (SparseCore's mixin:
    the configuration it reads is SparseCore's, set in its constructor)."""

    @cute.jit
    def finish_wgmma(self, acc_o, row_max, row_sum, sums, out, lse, partial_o, partial_ml, tid):
        """The end of a 64-row CTA (its 256 consumer threads): its rows' sums over both
        warpgroups (meeting at the consumers' named barrier), then out and lse (one split:
        normalized here) or the split's partials."""
        split, group, token = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        wg, w4 = warp // 4, warp % 4
        g, t = lane // 4, lane % 4
        head0 = group * WG_ROWS
        row0 = 16 * w4 + g
        # the row sums over the 4 lanes of a row, then over the two warpgroups
        sums_at = sums.iterator.toint()
        for rr in cutlass.range_constexpr(2):
            total = row_sum[rr] + cute.arch.shuffle_sync_bfly(row_sum[rr], offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            if t == 0:
                store_row_sum(sums_at + 4 * (wg * WG_ROWS + row0 + 8 * rr), total)
        P.named_sync(CONSUMER_BAR, WG_THREADS)
        item = token * self.splits + split
        for rr in cutlass.range_constexpr(2):
            head = head0 + row0 + 8 * rr
            total = load_row_sum(sums_at + 4 * (row0 + 8 * rr)) + load_row_sum(sums_at + 4 * (WG_ROWS + row0 + 8 * rr))
            dims = wg * (LATENT // 2) + 2 * t
            if cutlass.const_expr(self.splits == 1):  # the whole selection: normalize here
                if head < self.gathered:
                    inverse = self.inverse_of(total)
                    at = out + (token * self.gathered + head) * LATENT + dims
                    for j in cutlass.range_constexpr(32):
                        P.store_f32x2(at + 8 * j, acc_o[4 * j + 2 * rr] * inverse, acc_o[4 * j + 2 * rr + 1] * inverse)
                    if wg == 0 and t == 0:
                        P.store_f32(lse + token * self.gathered + head, self.lse_of(row_max[rr], total))
            else:
                at = partial_o + (item * self.q_heads + head) * LATENT + dims
                for j in cutlass.range_constexpr(32):
                    P.store_f32x2(at + 8 * j, acc_o[4 * j + 2 * rr], acc_o[4 * j + 2 * rr + 1])
                if wg == 0 and t == 0:
                    P.store_f32x2(partial_ml + 2 * (item * self.q_heads + head), row_max[rr], total)

    @cute.jit
    def partial_wgmma_ws(self, q_rows, slots, cache, partial_o, partial_ml, out, lse, q_out, error, pool_slots):
        """64-row CTAs with a producer warpgroup (384 threads). Warpgroup 2 (the producer) owns
        the slot ids, their range guard and the cache rows: block b into bf16 buffer b % 2
        (fp8 rows: loads issued, then the buffer's empty barrier, then dequantized into it;
        bf16 rows: cp.async into it once empty, signalled a block later so two blocks are in
        flight), its slot ids beside it, then it arrives on the buffer's full mbarrier.
        Warpgroups 0 and 1 wait on full, compute the block (consume_blocks) with named
        barriers of their 256 threads (no CTA barrier in the loop) and release the buffer on
        its empty mbarrier after their P @ V has completed. Shared memory: the query rows
        (bf16, K-major canonical), the two buffers of `block` cache rows as bf16, P (bf16,
        K-major), the two blocks' slot ids, the row maxima the warpgroups exchange, their row
        sums and the four mbarriers.
        crossover: the CTA and its peer (the other head group of the same split and token,
        a cluster of 2) share the blocks' rows: each producer loads (fp8: and dequantizes) its
        half into both CTAs' buffers (bf16 rows through registers, not by cp.async), full[s]
        also waits for the peer's bytes and empty[s] for the peer's consumers
        (produce_blocks); the mbarriers' initialization is published to
        the peer by a cluster barrier (arrived on here, waited on before any remote access),
        and every thread meets the peer's at a second one before it exits.
        trace: the trace probe's words (TRACE_WORDS), CTA-local."""
        tid, _, _ = cute.arch.thread_idx()
        split, group, token = cute.arch.block_idx()
        warp = tid // 32
        block = self.block
        trace = partial_o + (token * self.q_heads + group * WG_ROWS) * LATENT  # the trace probe's words
        self.stamp(trace, TRACE_START, tid == 0)
        smem = cutlass.memory.SmemAllocator()
        q_s = smem.allocate_tensor(Uint8, cute.make_layout(TILE_BYTES), byte_alignment=128).iterator.toint()
        kv_s = smem.allocate_tensor(Uint8, cute.make_layout(2 * TILE_BYTES), byte_alignment=128).iterator.toint()
        p_s = smem.allocate_tensor(Uint8, cute.make_layout(block // 8 * CHUNK), byte_alignment=128).iterator.toint()
        ids_s = smem.allocate_tensor(Int32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        red = smem.allocate_tensor(Float32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        sums = smem.allocate_tensor(Float32, cute.make_layout(2 * WG_ROWS), byte_alignment=16)
        bars = smem.allocate_tensor(Int64, cute.make_layout(4), byte_alignment=8).iterator.toint()
        full0, empty0 = bars, bars + 16  # full[s] at full0 + 8 s, empty[s] at empty0 + 8 s
        # crossover: empty[s] also counts the peer's consumer warps (remote arrivals)
        releases = 16 if self.crossover else 8
        if tid == 0:
            for s in cutlass.range_constexpr(2):
                P.mbar_init(full0 + 8 * s, 128)  # every producer thread, after its stores
                P.mbar_init(empty0 + 8 * s, releases)  # lane 0 of each consumer warp, after its P @ V
            P.mbar_init_fence()
        cute.arch.sync_threads()  # the mbarriers are initialized (the CTA's only full barrier)
        if cutlass.const_expr(self.crossover):
            # ... and, for the peer, by this cluster barrier (release), waited on by each thread
            # before its first remote store or arrive (the producer's / consumers' cluster_wait)
            cute.arch.cluster_arrive(aligned=True)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        consumers = (
            q_rows,
            q_out,
            out,
            lse,
            partial_o,
            partial_ml,
            q_s,
            kv_s,
            p_s,
            ids_s,
            red,
            sums,
            full0,
            empty0,
            tid,
            pool_slots,
            trace,
        )
        if cutlass.const_expr(self.reshape):
            regs = VALUES_RS_REGS if self.values_rs else (SCORER_REGS, VALUES_REGS, RESHAPE_PRODUCER_REGS)
            if warp < 4:
                cute.arch.setmaxregister_increase(regs[0])
                self.consume_blocks(*consumers, 0)
            elif warp < 8:
                if cutlass.const_expr(regs[1] > LAUNCH_REGS):  # (a dec past the launch's count traps)
                    cute.arch.setmaxregister_increase(regs[1])
                else:
                    cute.arch.setmaxregister_decrease(regs[1])
                self.consume_blocks(*consumers, 1)
            else:
                cute.arch.setmaxregister_decrease(regs[2])
                self.produce_blocks(
                    slots, cache, kv_s, ids_s, full0, empty0, tid - WG_THREADS, split, token, error, pool_slots, trace
                )
        elif warp >= WG_THREADS // 32:  # warpgroup 2
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce_blocks(
                slots, cache, kv_s, ids_s, full0, empty0, tid - WG_THREADS, split, token, error, pool_slots
            )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume_blocks(*consumers)

    @cute.jit
    def produce_blocks(
        self, slots, cache, kv_s, ids_s, full0, empty0, ptid, split, token, error, pool_slots, trace=None, share=None
    ):
        """The producer warpgroup (ptid 0 .. 127): each thread does two shares of a block's
        chunks (fetch_rows / store_rows, v = 0 and 1: producer_map's virtual threads ptid
        and ptid + 128); the next block's slot ids load a block ahead.

        share (the transposed path, kernels/sparse_core_transposed.py: two producer warpgroups
        in one CTA): this warpgroup loads share v = `share` of every block alone -- fp8 rows as
        a crossover CTA does (the same one-share branch, its prefetch included) with no peer:
        no pushes, no cluster scope; bf16 rows by cp.async, signalled a block later -- and
        full[s] counts both warpgroups' 256 arrivals; the slot ids (both shares') are recorded
        by warpgroup 0.

        crossover (this CTA rank c of a cluster of 2, its peer 1 - c): the thread loads only
        share v = c (rows 32 c .. 32 c + 31 of each block: XOVER_ROWS) into registers -- fp8
        rows then dequantized, bf16 rows as raw 16-byte chunks (fetch_rows' raw: predicated
        loads, all 18 issued before the buffer's empty wait, as the fp8 rows' are) -- and
        stores each 16-byte bf16 chunk twice, st.shared into its own buffer and st.async into
        the same place of the peer's (complete_tx on the peer's full[s]); the slot ids, their
        range guard and the error word stay whole in each CTA (both shares' ids, as without).
        Protocol (both CTAs alike):
        - full[s]: 128 local arrivals (after this CTA's stores and proxy fence; producer thread
          0's arrival also expects XOVER_BYTES) + the peer's XOVER_BYTES of st.async. The
          peer's bytes of block b may land before this CTA's expect: the tx-count goes below
          zero, and the phase cannot complete before the local arrivals anyway.
        - empty[s]: 16 arrivals, lane 0 of each consumer warp of both CTAs (the peer's by
          mapa + mbarrier.arrive.release at CTA scope), so stage s is rewritten (here and, by the
          pushes, in the peer) only once both CTAs' consumers finished block b - 2 there;
          waited on with acquire at cluster scope, as full[s] is (the peer's data).
        - The consumers skip the remote arrive for a CTA's last two blocks (no producer waits
          for those phases), so every remote arrive lands on a phase its owner waits for and
          every push is waited for by the peer's consumers: neither CTA can have exited when
          the other's pushes or arrivals reach it. A closing cluster barrier (every thread,
          after its last remote store or arrive) keeps both CTAs resident until both are
          done, as FlashMLA does.
        st.async (not st.shared::cluster + a remote arrive): the bytes count themselves on the
        peer's full[s] (no fence or second arrive per block, no round trip before the
        arrive), and the one mbarrier covers local and remote halves. The peer's tile and
        full barrier are mapped once (mapa) and offset per chunk, not mapped per store."""
        block = self.block
        blocks = self.slots_per_cta // block
        maps = []
        for v in cutlass.range_constexpr(2):
            r, cg0, q4 = producer_map(ptid, v, block)
            maps.append((r, cg0, q4, (cg0 == 0) & (q4 == 0)))  # the writer: chunk 0's thread
        ids_row = slots + token * self.k + split * self.slots_per_cta
        slot = [P.load_i32(ids_row + maps[v][0]) for v in range(2)]
        rank = Int32(0)  # one share: the share of each block this thread loads (crossover: its CTA's rank)
        half = maps[0]
        peer_kv, peer_full0 = kv_s, full0  # crossover: the peer's tile and full[0] (shared::cluster)
        # the one-share branch: the crossover's, and the transposed path's over fp8 rows (over bf16
        # rows it takes the cp.async branch, its own share only)
        one_share = self.crossover or (share is not None and self.mla_fp8)
        if cutlass.const_expr(self.crossover or share is not None):
            rank = share if share is not None else cute.arch.block_idx_in_cluster()
            r, cg0, q4 = producer_map(ptid, rank, block)
            half = (r, cg0, q4, (cg0 == 0) & (q4 == 0))
        if cutlass.const_expr(self.crossover):
            peer_kv = P.mapa(kv_s, 1 - rank)
            peer_full0 = P.mapa(full0, 1 - rank)
            cute.arch.cluster_wait()  # the peer's mbarriers are initialized
        ahead = slot  # prefetch: the slot ids of the block after the next (here block 1's)
        staged_next = []  # prefetch: the rows of the block this iteration stores
        if cutlass.const_expr(self.prefetch):
            ahead = [P.load_i32(ids_row + min(1, blocks - 1) * block + maps[v][0]) for v in range(2)]
            first = self.own_slot(slot, rank, Int32(0), blocks)
            staged_next = self.fetch_rows(cache, first, kv_s, half[0], half[1], half[2], pool_slots, True)
        for b in range(blocks):
            s = b % 2
            buf = kv_s + s * TILE_BYTES
            fetched = slot
            if cutlass.const_expr(self.probing("no_loads")):
                fetched = [Int32(-1), Int32(-1)]
            # the next block's slots (past the CTA's last block: the last block's again, unused)
            upcoming = []
            if cutlass.const_expr(self.prefetch):  # loaded an iteration ago; this one loads the one after
                upcoming = ahead
                ahead = [P.load_i32(ids_row + cutlass.min(b + 2, blocks - 1) * block + maps[v][0]) for v in range(2)]
            else:
                upcoming = [P.load_i32(ids_row + cutlass.min(b + 1, blocks - 1) * block + maps[v][0]) for v in range(2)]
            if cutlass.const_expr(one_share):
                staged = []
                if cutlass.const_expr(self.prefetch):  # this block's rows landed meanwhile; the next block's issued
                    staged = staged_next
                    own_next = self.own_slot(upcoming, rank, b + 1, blocks)
                    staged_next = self.fetch_rows(cache, own_next, buf, half[0], half[1], half[2], pool_slots, True)
                else:
                    own = P.select_i32(rank == 0, fetched[0], fetched[1])
                    staged = self.fetch_rows(cache, own, buf, half[0], half[1], half[2], pool_slots, True)
                self.stamp(trace, TRACE_PRODUCER + 3 * b, ptid == 0)
                if b >= 2:  # block b - 2's consumers (crossover: both CTAs') are done with the buffers
                    P.mbar_wait(empty0 + 8 * s, (b // 2 + 1) % 2, cluster=self.crossover)
                self.stamp(trace, TRACE_PRODUCER + 3 * b + 1, ptid == 0)
                push = None  # (no_push: the peer's half never comes)
                if cutlass.const_expr(self.crossover and not self.probing("no_push")):
                    push = (peer_kv + s * TILE_BYTES, peer_full0 + 8 * s)
                self.store_rows(staged, buf, half[0], half[1], half[2], push)
                self.stamp(trace, TRACE_PRODUCER + 3 * b + 2, ptid == 0)
                if cutlass.const_expr(self.crossover):
                    self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                elif rank == 0:  # (two producer warpgroups: one records both shares' ids)
                    self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                P.fence_proxy_async()  # generic-proxy shared writes -> the consumers' wgmma
                if cutlass.const_expr(self.crossover and not self.probing("no_push")):
                    if ptid == 0:  # the peer's bytes, expected with this arrival
                        P.mbar_expect(full0 + 8 * s, Int32(XOVER_BYTES))
                    else:
                        P.mbar_arrive(full0 + 8 * s)
                else:
                    P.mbar_arrive(full0 + 8 * s)
            elif cutlass.const_expr(self.mla_fp8):
                staged = [
                    self.fetch_rows(cache, fetched[v], buf, maps[v][0], maps[v][1], maps[v][2], pool_slots)
                    for v in range(2)
                ]
                if b >= 2:  # block b - 2's consumers are done with the buffer
                    P.mbar_wait(empty0 + 8 * s, (b // 2 + 1) % 2)
                for v in cutlass.range_constexpr(2):
                    self.store_rows(staged[v], buf, maps[v][0], maps[v][1], maps[v][2])
                self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                P.fence_proxy_async()  # generic-proxy shared writes -> the consumers' wgmma
                P.mbar_arrive(full0 + 8 * s)
            else:
                if b >= 2:
                    P.mbar_wait(empty0 + 8 * s, (b // 2 + 1) % 2)
                if cutlass.const_expr(share is None):
                    for v in cutlass.range_constexpr(2):
                        self.fetch_rows(cache, fetched[v], buf, maps[v][0], maps[v][1], maps[v][2], pool_slots)
                    P.cp_async_commit()
                    self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                else:
                    own = P.select_i32(rank == 0, fetched[0], fetched[1])
                    self.fetch_rows(cache, own, buf, half[0], half[1], half[2], pool_slots)
                    P.cp_async_commit()
                    if rank == 0:
                        self.record_ids(ids_s, s, slot, maps, token, error, pool_slots)
                if b >= 1:  # block b - 1's copies (this thread's) have landed: its buffer is full
                    P.cp_async_wait(1)
                    P.fence_proxy_async()
                    P.mbar_arrive(full0 + 8 * (1 - s))
            slot = upcoming
        if cutlass.const_expr(not (self.mla_fp8 or one_share)):  # the cp.async branch's last block
            P.cp_async_wait(0)
            P.fence_proxy_async()
            P.mbar_arrive(full0 + 8 * ((blocks - 1) % 2))
        if cutlass.const_expr(self.crossover):  # the closing cluster barrier (see above)
            cute.arch.cluster_arrive(aligned=True)
            cute.arch.cluster_wait()

    @cute.jit
    def own_slot(self, ids, rank, b, blocks: int):
        """The crossover's prefetch: the slot id of the row this thread loads in block b (its
        CTA's share, `rank`, of the block's two ids); -1 (a hole: nothing loaded) past the
        CTA's last block, and under the no_loads probe."""
        own = P.select_i32(rank == 0, ids[0], ids[1])
        if cutlass.const_expr(self.probing("no_loads")):
            own = Int32(-1)
        return P.select_i32(b < blocks, own, Int32(-1))

    @cute.jit
    def stamp(self, trace, word, who):
        """The trace probe: thread `who`'s %clock into int32 word `word` of its CTA's trace."""
        if cutlass.const_expr(self.probing("trace")):
            if who:
                P.store_i32(trace + word, cute.arch.clock())

    @cute.jit
    def record_ids(self, ids_s, s, slot, maps, token, error, pool_slots):
        """The block's slot ids beside buffer s (the consumers' -inf mask), each by its row's
        chunk-0 thread, which also records a slot outside the pool in the error word."""
        for v in cutlass.range_constexpr(2):
            r, _, _, writer = maps[v]
            if writer:
                ids_s[s * WG_ROWS + r] = slot[v]
                if slot[v] != -1 and not P.in_range(slot[v], pool_slots):
                    P.record_range(error, guards.SPARSE_CORE_SLOT, token, slot[v])

    @cute.jit
    def consume_blocks(
        self,
        q_rows,
        q_out,
        out,
        lse,
        partial_o,
        partial_ml,
        q_s,
        kv_s,
        p_s,
        ids_s,
        red,
        sums,
        full0,
        empty0,
        tid,
        pool_slots,
        trace,
        role: int | None = None,
    ):
        """The consumer warpgroups (tid 0 .. 255) between each buffer's full and empty
        mbarriers, in one of two shapes (RESHAPE_BLOCKS):

        role None: consume_block, each warpgroup scoring half the block (its slots
        wg x block / 2 ..), the row max and P exchanged over two named barriers of the 256
        threads, then its P @ V on dims 256 wg .. 256 wg + 255 over the whole block.
        The next block needs no third barrier: a warpgroup writes its next row maxima (`red`)
        after this block's second barrier, which the other reaches only once it has read this
        block's; and its next P after the next block's first barrier, which the other reaches
        only once its P @ V over this block has completed.

        role 0 / 1: FlashMLA's shape, this thread's warpgroup: 0 scores each block whole and
        does P @ V on dims 0 .. 255 (score_block), 1 does P @ V on dims 256 .. 511
        (values_block_half); P and the rows' rescale factors (`red`, 64 words) handed over by
        named barriers: P_READY (0 arrives once they are in shared memory, 1 waits) and P_FREE
        (1 arrives once its P @ V over them has completed, 0 waits before it writes the next
        block's). Only warpgroup 0 keeps row maxima and sums; 1's sums are zeros in
        finish_wgmma.

        crossover: full[s] is waited on with acquire at cluster scope (half the block is the
        peer's st.async), and lane 0 of each warp also releases the buffer to the peer's
        producer (its empty[s], mapa + arrive.release at CTA scope) but for the CTA's last two
        blocks (produce_blocks has the protocol); the thread passes the cluster barrier the
        kernel arrived on after initializing its mbarriers before its first remote arrive, and
        meets the peer at the closing one around finish_wgmma. trace: the trace probe's words."""
        _, group, token = cute.arch.block_idx()
        lane = tid % 32
        blocks = self.slots_per_cta // self.block
        head0 = group * WG_ROWS
        self.load_query_tile(q_rows + (token * self.q_heads + head0) * self.q_bytes, head0, q_s, tid)
        P.cp_async_commit()
        P.cp_async_wait(0)
        P.fence_proxy_async()  # generic-proxy shared writes (and cp.async data) -> wgmma
        P.named_sync(CONSUMER_BAR, WG_THREADS)
        peer = Int32(0)  # crossover: the other CTA of the pair
        if cutlass.const_expr(self.crossover):
            peer = 1 - cute.arch.block_idx_in_cluster()
            cute.arch.cluster_wait()  # the peer's mbarriers are initialized
        if cutlass.const_expr(self.publish and self.splits == 1):  # this CTA is its rows' only reader
            self.publish_rows(q_rows, q_out, token, head0, WG_ROWS, tid, WG_THREADS)

        neg_inf = Float32(-math.inf)
        acc_o = [Float32(0)] * 128
        row_max = [neg_inf, neg_inf]  # rows 16 w4 + g (+ 8), log2 units (role 1: unused)
        row_sum = [Float32(0), Float32(0)]  # this thread's share (role 1: unused)
        for b in range(blocks):
            s = b % 2
            cur = kv_s + s * TILE_BYTES
            # (the cta_full probe: at CTA scope, without the L1 invalidation the cluster's acquire costs)
            acquire = self.crossover and not self.probing("cta_full")
            P.mbar_wait(full0 + 8 * s, (b // 2) % 2, cluster=acquire)
            if cutlass.const_expr(self.crossover):
                P.fence_proxy_async()  # the peer's st.async rows (generic proxy) -> this thread's wgmma
            self.stamp(trace, TRACE_SCORER + 4 * b, tid == 0)
            if cutlass.const_expr(not self.probing("no_math")):
                if cutlass.const_expr(role is None):
                    row_max, row_sum, acc_o = self.consume_block(
                        q_s, cur, p_s, ids_s, s, red, row_max, row_sum, acc_o, tid, pool_slots
                    )
                elif cutlass.const_expr(role == 0):
                    row_max, row_sum, acc_o = self.score_block(
                        q_s, cur, p_s, ids_s, s, red, row_max, row_sum, acc_o, tid, pool_slots, b > 0, trace, b
                    )
                    self.stamp(trace, TRACE_SCORER + 4 * b + 3, tid == 0)
                else:
                    acc_o = self.values_block_half(cur, p_s, red, acc_o, tid, b < blocks - 1, trace, b)
            if lane == 0:  # this warp's reads of buffer s (its wgmmas, the slot ids) are done
                P.mbar_arrive(empty0 + 8 * s)
                if cutlass.const_expr(self.crossover):
                    if b < blocks - 2:  # the peer's producer waits for it (before block b + 2)
                        P.mbar_arrive_remote(empty0 + 8 * s, peer)

        if cutlass.const_expr(self.crossover):  # this thread's last remote access is done
            cute.arch.cluster_arrive(aligned=True)
        self.finish_wgmma(acc_o, row_max, row_sum, sums, out, lse, partial_o, partial_ml, tid)
        if cutlass.const_expr(self.crossover):
            cute.arch.cluster_wait()

    @cute.jit
    def score_block(
        self, q_s, cur, p_s, ids_s, s, factors, row_max, row_sum, acc_o, tid, pool_slots, wait_free, trace=None, b=0
    ):
        """Warpgroup 0 of consume_blocks' FlashMLA shape, one block (buffer s at cur): S = Q x K^T over all
        its slots (m64n(block)k16), holes -inf, the online softmax in registers, P as bf16
        words -- the A fragments of P @ V -- and the rows' factors 2^(old max - new max) into
        shared memory for warpgroup 1 (after P_FREE when wait_free: it has read the last
        block's), then O[:, 0 .. 255] += P x V with P from registers (completed on return)."""
        lane, w4 = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        block = self.block
        row0 = 16 * w4 + g
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)
        sc = wgmma_scores(q_s, cur, block)
        self.stamp(trace, TRACE_SCORER + 4 * b + 1, tid == 0)
        for j in cutlass.range_constexpr(block // 8):
            for e in cutlass.range_constexpr(2):
                live = P.in_range(ids_s[s * WG_ROWS + 8 * j + 2 * t + e], pool_slots)
                for rr in cutlass.range_constexpr(2):
                    sc[4 * j + 2 * rr + e] = P.select(live, sc[4 * j + 2 * rr + e] * scale, neg_inf)
        alpha = [Float32(0), Float32(0)]
        use = [Float32(0), Float32(0)]
        for rr in cutlass.range_constexpr(2):
            top = row_max[rr]
            for j in cutlass.range_constexpr(block // 8):
                top = cute.arch.fmax(top, cute.arch.fmax(sc[4 * j + 2 * rr], sc[4 * j + 2 * rr + 1]))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=2))
            use[rr] = P.select(top == neg_inf, Float32(0), top)  # no live slot yet: 2^-inf = 0
            alpha[rr] = P.exp2_approx(row_max[rr] - use[rr])
            row_max[rr] = top
            row_sum[rr] = row_sum[rr] * alpha[rr]
        words = []  # word i = 2 j + rr: row row0 + 8 rr, slots 8 j + 2 t, + 1
        for i in cutlass.range_constexpr(block // 4):
            p0 = P.exp2_approx(sc[2 * i] - use[i % 2])
            p1 = P.exp2_approx(sc[2 * i + 1] - use[i % 2])
            row_sum[i % 2] = row_sum[i % 2] + p0 + p1
            words.append(P.pack_bf16x2(p0, p1))
        acc_o = self.rescale(acc_o, alpha)
        if wait_free:
            P.named_sync(P_FREE, WG_THREADS)
        for i in cutlass.range_constexpr(block // 4):
            P.st_shared_u32(p_s + i // 2 * CHUNK + (row0 + 8 * (i % 2)) * 16 + 4 * t, words[i])
        if t == 0:
            for rr in cutlass.range_constexpr(2):
                store_factor(factors.iterator.toint() + 4 * (row0 + 8 * rr), alpha[rr])
        P.fence_proxy_async()  # P -> warpgroup 1's wgmma
        P.named_arrive(P_READY, WG_THREADS)
        self.stamp(trace, TRACE_SCORER + 4 * b + 2, tid == 0)
        acc_o = P.wgmma_bf16_rs(acc_o, words, cur, DESC_V, 16 * 16, True)
        return row_max, row_sum, acc_o

    @cute.jit
    def values_block_half(self, cur, p_s, factors, acc_o, tid, arrive_free, trace=None, b=0):
        """Warpgroup 1 of consume_blocks' FlashMLA shape, one block: once P_READY, O[:, 256 .. 511] rescaled
        by the rows' factors, += P x V (P from shared memory, as wgmma's A or, VALUES_RS, loaded
        into registers first; completed on return), then
        P_FREE (arrive_free: not after the CTA's last block, which nothing waits for)."""
        lane, w4 = tid % 32, tid // 32 - 4
        row0, t = 16 * w4 + lane // 4, lane % 4
        P.named_sync(P_READY, WG_THREADS)
        self.stamp(trace, TRACE_VALUES + 3 * b, tid == WG_THREADS // 2)
        alpha = [load_factor(factors.iterator.toint() + 4 * (row0 + 8 * rr)) for rr in range(2)]
        words = []
        if cutlass.const_expr(self.values_rs):  # the scorer's words for these rows, as score_block stored them
            for i in cutlass.range_constexpr(self.block // 4):
                words.append(P.ld_shared_i32(p_s + i // 2 * CHUNK + (row0 + 8 * (i % 2)) * 16 + 4 * t))
        acc_o = self.rescale(acc_o, alpha)
        v_half = cur + (LATENT // 2 // 8) * CHUNK
        self.stamp(trace, TRACE_VALUES + 3 * b + 1, tid == WG_THREADS // 2)
        if cutlass.const_expr(self.values_rs):
            acc_o = P.wgmma_bf16_rs(acc_o, words, v_half, DESC_V, 16 * 16, True)
        else:
            acc_o = wgmma_values(acc_o, p_s, v_half, self.block // 16)
        self.stamp(trace, TRACE_VALUES + 3 * b + 2, tid == WG_THREADS // 2)
        if arrive_free:
            P.named_arrive(P_FREE, WG_THREADS)
        return acc_o

    @cute.jit
    def rescale(self, acc_o, alpha, factor_of=lambda i: (i // 2) % 2):
        """This thread's output accumulators x their rows' factors: accumulator i by
        alpha[factor_of(i)] (FlashMLA's consumer shape: 128 of rows row0, row0 + 8, alpha[0],
        alpha[1]; the transposed path: 64 of 4 heads). SKIP_UNMOVED: not where no factor of
        the warp moved (every factor exactly 2^0 = 1: the product would be the accumulator itself)."""
        out = acc_o
        if cutlass.const_expr(self.skip_unmoved):
            moved = alpha[0] != Float32(1.0)
            for a in alpha[1:]:
                moved = moved | (a != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                out = [acc_o[i] * alpha[factor_of(i)] for i in range(len(acc_o))]
        else:
            out = [acc_o[i] * alpha[factor_of(i)] for i in range(len(acc_o))]
        return out

    @cute.jit
    def consume_block(self, q_s, cur, p_s, ids_s, s, red, row_max, row_sum, acc_o, tid, pool_slots):
        """One block of consume_blocks (buffer s at cur): scores of this warpgroup's half,
        the row max over both (named barrier), P into shared memory (named barrier), P @ V
        (completed on return)."""
        lane, warp = tid % 32, tid // 32
        wg, w4 = warp // 4, warp % 4
        g, t = lane // 4, lane % 4
        block = self.block
        half = block // 2
        row0 = 16 * w4 + g
        sc = wgmma_scores(q_s, cur + wg * half * 16, half)
        row_max, row_sum, acc_o = self.block_softmax(
            sc, ids_s, s, red, p_s, row_max, row_sum, acc_o, wg, row0, t, pool_slots
        )
        acc_o = wgmma_values(acc_o, p_s, cur + wg * (LATENT // 2 // 8) * CHUNK, block // 16)
        return row_max, row_sum, acc_o

    @cute.jit
    def block_softmax(self, sc, ids_s, s, red, p_s, row_max, row_sum, acc_o, wg, row0, t, pool_slots):
        """The online softmax of one block in the 64-row paths, from this warpgroup's half of
        the scores (sc, wgmma_scores) to P in shared memory: slots outside the pool scored
        -inf (the block's ids beside buffer s), each row's max over both halves exchanged
        through `red`, the running max and sum and the output accumulators rescaled, P
        stored as bf16 for P @ V. The two exchanges meet at the consumers' named barrier
        (CONSUMER_BAR: the producer warpgroup runs on). wg: this thread's
        warpgroup, row0: its first row (16 w4 + g), t: its lane in the quad. Returns
        (row_max, row_sum, acc_o)."""
        half = self.block // 2
        scale = Float32(self.softmax_scale * LOG2E)
        neg_inf = Float32(-math.inf)
        for j in cutlass.range_constexpr(half // 8):
            for e in cutlass.range_constexpr(2):
                live = P.in_range(ids_s[s * WG_ROWS + wg * half + 8 * j + 2 * t + e], pool_slots)
                for rr in cutlass.range_constexpr(2):
                    sc[4 * j + 2 * rr + e] = P.select(live, sc[4 * j + 2 * rr + e] * scale, neg_inf)
        for rr in cutlass.range_constexpr(2):
            top = sc[2 * rr]
            for j in cutlass.range_constexpr(half // 8):
                top = cute.arch.fmax(top, cute.arch.fmax(sc[4 * j + 2 * rr], sc[4 * j + 2 * rr + 1]))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1))
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=2))
            if t == 0:
                red[wg * WG_ROWS + row0 + 8 * rr] = top
        P.named_sync(CONSUMER_BAR, WG_THREADS)  # both halves' maxima
        alpha = [Float32(0), Float32(0)]
        use = [Float32(0), Float32(0)]
        for rr in cutlass.range_constexpr(2):
            top = cute.arch.fmax(row_max[rr], cute.arch.fmax(red[row0 + 8 * rr], red[WG_ROWS + row0 + 8 * rr]))
            use[rr] = P.select(top == neg_inf, Float32(0), top)  # no live slot yet: 2^-inf = 0
            alpha[rr] = P.exp2_approx(row_max[rr] - use[rr])
            row_max[rr] = top
            row_sum[rr] = row_sum[rr] * alpha[rr]
        for j in cutlass.range_constexpr(half // 8):
            p = [P.exp2_approx(sc[4 * j + q] - use[q // 2]) for q in range(4)]
            row_sum[0] = row_sum[0] + p[0] + p[1]
            row_sum[1] = row_sum[1] + p[2] + p[3]
            at = p_s + (wg * half // 8 + j) * CHUNK + row0 * 16 + 4 * t
            P.st_shared_u32(at, P.pack_bf16x2(p[0], p[1]))
            P.st_shared_u32(at + 8 * 16, P.pack_bf16x2(p[2], p[3]))
        for i in cutlass.range_constexpr(128):
            acc_o[i] = acc_o[i] * alpha[(i // 2) % 2]
        P.fence_proxy_async()
        P.named_sync(CONSUMER_BAR, WG_THREADS)  # the block's P (both halves) is in shared memory
        return row_max, row_sum, acc_o

    @cute.jit
    def fetch_rows(self, cache, slot, dst, r, cg0, q4, pool_slots, raw: bool = False) -> list:
        """This thread's chunks of cache row `slot` (block row r): bf16 rows by cp.async
        straight into dst (the caller commits; returns []), or raw (the crossover, whose
        producer stores each chunk into two tiles) by predicated 16-byte loads into registers
        as they are; fp8 rows by predicated loads into registers. Registers are returned for
        store_rows. Chunk j: 4 (cg0 + step j) + q4 of the row's 72 (8 dims each); a hole or a
        slot outside the pool reads nothing (zeros). fp8 rows under sparse_core.FP8_ROW_LOADS
        "16B" (wide_fp8, 64-slot blocks): the latent two chunks a load instead."""
        step = 8 // (self.block // 8)
        live = P.in_range(slot, pool_slots)
        row = Int64(P.select_i32(live, slot, 0)) * self.row_bytes
        staged = []
        if cutlass.const_expr(not self.mla_fp8 and not raw):
            src = cache + row + 16 * q4
            at = dst + r * 16 + q4 * CHUNK
            for j in cutlass.range_constexpr((TILE_CHUNKS // 4 + step - 1) // step):
                c4 = cg0 + step * j  # chunk 4 c4 + q4
                if cutlass.const_expr(step * (j + 1) <= TILE_CHUNKS // 4):
                    P.cp_async_16(at + 4 * CHUNK * c4, src + 64 * c4, live)
                elif c4 < TILE_CHUNKS // 4:
                    P.cp_async_16(at + 4 * CHUNK * c4, src + 64 * c4, live)
        elif cutlass.const_expr(self.wide_fp8):
            # FP8_ROW_LOADS "16B": pair j of the latent (chunks 8 j + 2 q4 and + 1: 16 e4m3 at
            # 64 j + 16 q4), then the rope's chunks 64 + q4 and 68 + q4 (cg0 is 0 at 64-slot blocks)
            src = cache + row
            staged.append(P.load_f32x4_if(src + LATENT, live))  # the row's 4 fp32 scales
            for j in cutlass.range_constexpr(LATENT // 64):
                staged.append(P.load_u32x4_if(src + 64 * j + 16 * q4, live))
            for j in cutlass.range_constexpr(2):
                staged.append(P.load_u32x4_if(src + LATENT + 16 + 16 * (4 * j + q4), live))
        else:
            src = cache + row
            if cutlass.const_expr(self.mla_fp8):
                staged.append(P.load_f32x4_if(src + LATENT, live))  # the row's 4 fp32 scales
            for j in cutlass.range_constexpr((TILE_CHUNKS // 4 + step - 1) // step):
                staged.append(self.fetch_piece(src, live, cg0, q4, j))
        return staged

    @cute.jit
    def fetch_piece(self, src, live, cg0, q4, j: int):
        """Piece j of fetch_rows' row at src in registers: chunk 4 (cg0 + step j) + q4 of its
        72 -- fp8 rows: 8 e4m3 of the latent (8 bytes at 8 c), or 8 bf16 of the rope (16 bytes
        at 528 + 16 (c - 64)); bf16 rows: the 16 bytes at 16 c -- zeros where not live (or
        past the row's chunks)."""
        step = 8 // (self.block // 8)
        c4 = cg0 + step * j
        words = None
        if cutlass.const_expr(not self.mla_fp8):
            inside = live if step * (j + 1) <= TILE_CHUNKS // 4 else live & (c4 < TILE_CHUNKS // 4)
            words = P.load_u32x4_if(src + 16 * (4 * c4 + q4), inside)
        elif cutlass.const_expr(step * (j + 1) <= LATENT // 32):
            words = P.load_u32x2_if(src + 8 * (4 * c4 + q4), live)
        else:
            words = P.load_u32x4_if(src + LATENT + 16 + 16 * (4 * (c4 - 16) + q4), live & (c4 < TILE_CHUNKS // 4))
        return words

    @cute.jit
    def store_piece(self, words, scales, at, cg0, j: int, remote=None):
        """fetch_piece's words -> its bf16 chunk of block row `at` (dst + 16 r + q4 x CHUNK):
        e4m3 x the chunk's 128-dim scale, rounded to bf16; bf16 (the rope, or a raw bf16 row)
        copied. remote (the crossover): (the same row's address in the peer's tile, the peer's
        full mbarrier), both shared::cluster; the chunk is also pushed there (st.async)."""
        step = 8 // (self.block // 8)
        c4 = cg0 + step * j
        if cutlass.const_expr(self.mla_fp8 and step * (j + 1) <= LATENT // 32):
            # chunk 4 c4 + q4 < 64: its scale is scales[c4 // 4], and c4 // 4 = step j // 4
            # for every cg0 < step (step divides 4)
            self.put_chunk(self.dequantize(words, scales[step * j // 4]), at, 4 * CHUNK * c4, remote)
        elif cutlass.const_expr(not self.mla_fp8 and step * (j + 1) <= TILE_CHUNKS // 4):
            self.put_chunk(words, at, 4 * CHUNK * c4, remote)  # (every thread's chunk is in the row)
        elif cutlass.const_expr(step * j < TILE_CHUNKS // 4):
            if c4 < TILE_CHUNKS // 4:
                self.put_chunk(words, at, 4 * CHUNK * c4, remote)

    @cute.jit
    def put_chunk(self, words, at, offset, remote):
        """A bf16 chunk (4 words) to shared at + offset, and (remote: the crossover's peer tile
        and full mbarrier) by st.async to remote[0] + offset, counted on remote[1]."""
        P.st_shared_u32x4(at + offset, words)
        if cutlass.const_expr(remote is not None):
            P.st_async_u32x4(remote[0] + offset, words, remote[1])

    @cute.jit
    def store_rows(self, staged, dst, r, cg0, q4, remote=None):
        """fetch_rows' registers -> bf16 chunks of block row r in dst: fp8 rows' e4m3 x the
        chunk's 128-dim scale, rounded to bf16, their rope and raw bf16 rows copied. remote
        (the crossover): (the peer's dst, the peer's full mbarrier), shared::cluster: every
        chunk also pushed there."""
        at = dst + r * 16 + q4 * CHUNK
        there = None
        if cutlass.const_expr(remote is not None):
            there = (remote[0] + r * 16 + q4 * CHUNK, remote[1])
        pieces, scales = (staged[1:], staged[0]) if self.mla_fp8 else (staged, None)
        if cutlass.const_expr(self.wide_fp8):
            # fetch_rows' pairs: chunks 8 j + 2 q4 and + 1, at + (8 j + q4) x CHUNK (at holds
            # q4 x CHUNK); the rope's chunks 64 + q4 and 68 + q4
            pair_at = at + q4 * CHUNK
            pair_there = None
            if cutlass.const_expr(remote is not None):
                pair_there = (there[0] + q4 * CHUNK, there[1])
            for j in cutlass.range_constexpr(LATENT // 64):
                self.store_pair(pieces[j], scales[j // 2], pair_at, 8 * j * CHUNK, pair_there)
            for j in cutlass.range_constexpr(2):
                self.put_chunk(pieces[LATENT // 64 + j], at, (64 + 4 * j) * CHUNK, there)
        else:
            for j in cutlass.range_constexpr(len(pieces)):
                self.store_piece(pieces[j], scales, at, cg0, j, there)

    @cute.jit
    def store_pair(self, words, sc, at, offset, remote=None):
        """16 e4m3 (FP8_ROW_LOADS "16B": two chunks' latent in one load) x their 128-dim scale
        sc, rounded to bf16, as two chunks: at + offset and at + offset + CHUNK (remote: also
        pushed, as put_chunk)."""
        first, second = self.dequantize(words[:2], sc), self.dequantize(words[2:], sc)
        self.put_chunk(first, at, offset, remote)
        self.put_chunk(second, at, offset + CHUNK, remote)

    @cute.jit
    def dequantize(self, words, sc) -> list:
        """A chunk's 8 e4m3 (two words) x its 128-dim scale sc, rounded to bf16: the chunk's 4
        words (the no_dequant probe: the raw words twice over, the same stores without the math)."""
        if cutlass.const_expr(self.probing("no_dequant")):
            return [words[0], words[1], words[0], words[1]]
        outw = []
        for i in cutlass.range_constexpr(2):
            f = P.unpack_e4m3x4(words[i])
            outw.append(P.pack_bf16x2(f[0] * sc, f[1] * sc))
            outw.append(P.pack_bf16x2(f[2] * sc, f[3] * sc))
        return outw

    @cute.jit
    def load_query_tile(self, rows, head0, q_s, tid, tile_rows: int = WG_ROWS, threads: int = WG_THREADS):
        """The CTA's `tile_rows` query rows -> shared bf16 in the canonical K-major layout (chunk
        c of row h at c x 16 tile_rows + 16 h) by its `threads` threads: bf16 rows by cp.async
        (the caller commits and waits), e4m3 rows by loads all issued first and widened
        exactly; rows at or past `gathered` are zeros."""
        chunk = tile_rows * 16
        if cutlass.const_expr(self.q_fp8):
            items = tile_rows * (ROW // 16)  # 16 e4m3 (two chunks) each
            loads = []
            for i in cutlass.range_constexpr((items + threads - 1) // threads):
                index = tid + i * threads
                h, c2 = index % tile_rows, index // tile_rows
                src = rows + h * self.q_bytes + 16 * c2
                live = head0 + h < self.gathered
                partial = (i + 1) * threads > items  # the last round has fewer items than threads
                if cutlass.const_expr(partial):
                    live = live & (index < items)
                loads.append((P.load_u32x4_if(src, live), h, c2, index, partial))
            for words, h, c2, index, partial in loads:
                outw = []
                for j in cutlass.range_constexpr(4):
                    f = P.unpack_e4m3x4(words[j])
                    outw.append(P.pack_bf16x2(f[0], f[1]))
                    outw.append(P.pack_bf16x2(f[2], f[3]))
                if cutlass.const_expr(partial):
                    if index < items:
                        P.st_shared_u32x4(q_s + 2 * c2 * chunk + 16 * h, outw[:4])
                        P.st_shared_u32x4(q_s + (2 * c2 + 1) * chunk + 16 * h, outw[4:])
                else:
                    P.st_shared_u32x4(q_s + 2 * c2 * chunk + 16 * h, outw[:4])
                    P.st_shared_u32x4(q_s + (2 * c2 + 1) * chunk + 16 * h, outw[4:])
        else:
            for i in cutlass.range_constexpr(tile_rows * TILE_CHUNKS // threads):
                index = tid + i * threads
                h, c = index % tile_rows, index // tile_rows
                P.cp_async_16(q_s + c * chunk + 16 * h, rows + h * self.q_bytes + 16 * c, head0 + h < self.gathered)

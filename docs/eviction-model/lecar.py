"""LeCaR (regret-weighted mix of LRU and LFU with ghost histories) in the Python model of the
replay; usage: python3 lecar.py TRACE 1024,4096,16384"""
import sys, math, random, heapq, collections
from collections import OrderedDict
from model import load

def run(reqs, cap, lam=0.45, admit=False, seed=1):
    """admit=True: the LFU expert ranks by the global sighting count, not the in-cache one."""
    rnd = random.Random(seed)
    lru = OrderedDict()          # block -> None, least recent first
    freq = {}                    # in-cache frequency
    tick = {}                    # last access
    heap = []                    # (freq, tick, block), lazy
    hl, hf = OrderedDict(), OrderedDict()  # ghost histories: block -> time evicted
    w = [0.5, 0.5]
    disc = 0.005 ** (1.0 / cap)
    gfreq = collections.Counter()
    t = 0; hits = 0; total = 0
    for r in reqs:
        n = len(r); total += n
        h = 0
        while h < n and r[h] in lru: h += 1
        hits += h
        rs = set(r)
        need = sum(1 for b in r if b not in lru) - (cap - len(lru))
        while need > 0 and lru:
            use_lru = rnd.random() < w[0] / (w[0] + w[1])
            victim = None
            if use_lru:
                for b in lru:
                    if b not in rs: victim = b; break
            else:
                skipped = []
                while heap:
                    f, tk, b = heapq.heappop(heap)
                    if b in lru and freq[b] == f and tick[b] == tk:
                        if b in rs: skipped.append((f, tk, b)); continue
                        victim = b; break
                for e in skipped: heapq.heappush(heap, e)
            if victim is None: break
            del lru[victim]; del freq[victim]; del tick[victim]
            hist = hl if use_lru else hf
            hist[victim] = t
            if len(hist) > cap: hist.popitem(last=False)
            need -= 1
        if need > 0:
            for b in r: gfreq[b] += 1
            continue
        for k in range(n - 1, -1, -1):
            b = r[k]; t += 1
            if b in lru:
                lru.move_to_end(b); freq[b] += 1
            else:
                for i, hist in ((0, hl), (1, hf)):
                    if b in hist:
                        reward = disc ** (t - hist.pop(b))
                        # the expert that evicted it is penalised
                        w[i] *= math.exp(-lam * reward)
                        s = w[0] + w[1]; w[0] /= s; w[1] /= s
                lru[b] = None
                freq[b] = 1 + (gfreq[b] if admit else 0)
            tick[b] = t
            heapq.heappush(heap, (freq[b], t, b))
        for b in r: gfreq[b] += 1
    return hits / total

if __name__ == '__main__':
    reqs = load(sys.argv[1])
    for cap in [int(c) for c in sys.argv[2].split(',')]:
        print(cap, 'lecar', round(100 * run(reqs, cap), 2), 'lecar+global-freq', round(100 * run(reqs, cap, admit=True), 2), flush=True)

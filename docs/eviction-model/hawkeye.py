"""Hawkeye-style bound: label every access by whether Belady (at the same capacity, in this
model) keeps the block until its next use, estimate each feature bucket's share of such
accesses over the whole trace (hindsight: no online learner of OPT labels per bucket can do
better), and admit buckets at or above a threshold into LRU (the rest in probation).
usage: python3 hawkeye.py TRACE 4096"""
import sys, heapq, collections
from model import load, run
from bucket_features import bucket

def belady_labels(reqs, cap):
    nxt = {}; last = {}
    for i in range(len(reqs) - 1, -1, -1):
        for k, b in enumerate(reqs[i]): nxt[(i, k)] = last.get(b, 1 << 60)
        for b in reqs[i]: last[b] = i
    res = {}; heap = []; occ = collections.Counter(); label = {}
    cur = {}   # block -> (next use, occurrence key) of the resident copy
    hits = 0; total = 0
    for i, r in enumerate(reqs):
        n = len(r); total += n
        h = 0
        while h < n and r[h] in cur: h += 1
        hits += h
        for b in r:
            if b in cur: label[cur[b][1]] = True  # kept until this use
        rs = set(r)
        need = sum(1 for b in r if b not in cur) - (cap - len(cur))
        skipped = []
        while need > 0 and heap:
            nu, b = heapq.heappop(heap); nu = -nu
            if b not in cur or cur[b][0] != nu: continue
            if b in rs: skipped.append((-nu, b)); continue
            del cur[b]; need -= 1
        for e in skipped: heapq.heappush(heap, e)
        for k, b in enumerate(r):
            key = (b, occ[b]); occ[b] += 1
            label.setdefault(key, False)
            if need > 0 and b not in cur: continue
            cur[b] = (nxt[(i, k)], key)
            heapq.heappush(heap, (-nxt[(i, k)], b))
    return label, hits / total

if __name__ == '__main__':
    reqs = load(sys.argv[1]); cap = int(sys.argv[2])
    label, bh = belady_labels(reqs, cap)
    print('model belady', round(100 * bh, 2))
    freq = collections.Counter(); occ = collections.Counter()
    stat = collections.defaultdict(lambda: [0, 0])
    for r in reqs:
        n = len(r); h = 0
        while h < n and freq[r[h]] > 0: h += 1
        for k, b in enumerate(r):
            s = stat[bucket(freq[b], k, n, h)]
            s[0] += 1; s[1] += label[(b, occ[b])]
            occ[b] += 1
        for b in r: freq[b] += 1
    p = {k: v[1] / v[0] for k, v in stat.items()}
    out = []
    for th in [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]:
        out.append((th, round(100 * run(reqs, cap, lambda f, k, n, h, b, th=th: p.get(bucket(f, k, n, h), 0) >= th), 2)))
    print(cap, out)
    # a perfect per-access predictor of OPT's labels (no buckets): the ceiling of Hawkeye here
    print(cap, 'exact OPT labels', round(100 * run(reqs, cap, lambda f, k, n, h, b: label[(b, f)]), 2))

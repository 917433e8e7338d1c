"""Reuse-distance histogram (in block accesses) by sighting count; usage: python3 rd.py TRACE"""
import json,sys,collections,bisect
reqs=[json.loads(l)['hash_ids'] for l in open(sys.argv[1])]
last={}   # block -> clock at last access (clock = total blocks accessed so far)
clock=0
h=collections.Counter(); hf=collections.defaultdict(collections.Counter)
cnt=collections.Counter()
bins=[256,512,1024,2048,3072,4096,6144,8192,12288,16384,24576,32768,65536,1<<30]
never=collections.Counter()
tot=collections.Counter()
for r in reqs:
    for b in r:
        if b in last:
            d=clock-last[b]
            bi=bisect.bisect_left(bins,d)
            h[bins[bi]]+=1
            hf[min(cnt[b],3)][bins[bi]]+=1
        cnt[b]+=1
        last[b]=clock
    clock+=len(r)
print('total accesses',clock)
for k in bins: print(k, h[k], {f:hf[f][k] for f in sorted(hf)})

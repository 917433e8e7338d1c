"""Python model of `kvbm_logical::sim` (longest-prefix hits, request blocks protected, release
last block first): LRU, or admission into LRU with a probation FIFO evicted first.
Reproduces the Rust LRU figures (4.48% / 8.79% at 1,024 / 4,096 blocks, conversation trace)."""
import json,sys,collections
from collections import OrderedDict
def load(p):
    return [json.loads(l)['hash_ids'] for l in open(p)]
def run(reqs, cap, admit_fn=None, feat=None):
    """admit_fn(features)->bool; None: LRU. non-admitted go to probation (evicted first)."""
    main=OrderedDict(); prob=OrderedDict()
    freq=collections.Counter()
    hits=0; total=0
    for i,r in enumerate(reqs):
        n=len(r); total+=n
        h=0
        while h<n and (r[h] in main or r[h] in prob): h+=1
        hits+=h
        rs=set(r)
        newb=[b for b in r[h:] if not (b in main or b in prob)]
        need=len(newb)-(cap-len(main)-len(prob))
        ok=True
        if need>0:
            # evict from prob then main, skipping protected
            for od in (prob,main):
                if need<=0: break
                for b in list(od.keys()):
                    if need<=0: break
                    if b in rs: continue
                    del od[b]; need-=1
            if need>0: ok=False
        # release in reverse order
        for k in range(n-1,-1,-1):
            b=r[k]
            if b in main: main.move_to_end(b); continue
            if b in prob:
                # hit in probation -> admitted
                if k<h: del prob[b]; main[b]=1
                else: prob.move_to_end(b)
                continue
            if not ok: continue
            f=freq[b]
            if admit_fn is None or admit_fn(f,k,n,h,b): main[b]=1
            else: prob[b]=1
        for b in r: freq[b]+=1
    return hits/total
if __name__=='__main__':
    reqs=load(sys.argv[1])
    for cap in [1024,4096]:
        print(cap,'lru',round(100*run(reqs,cap),2),'adm2',round(100*run(reqs,cap,lambda f,k,n,h,b:f>=1),2))

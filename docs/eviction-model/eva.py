"""EVA-style eviction (per-class age histograms of hits and evictions, value ranking) in the
Python model of the replay; usage: python3 eva.py TRACE 4096"""
import sys,collections
from collections import OrderedDict
from model import load
def run(reqs, cap, NC=4, BINS=128, binw_div=16, decay=0.8, period_mult=1, chain=True, ends=True):
    w=max(1,cap//binw_div)
    lists=[OrderedDict() for _ in range(NC)]
    where={}   # block -> class
    t_last={}
    freq=collections.Counter()
    H=[[0.0]*BINS for _ in range(NC)]; E=[[0.0]*BINS for _ in range(NC)]
    V=[[0.0]*BINS for _ in range(NC)]
    clock=0; hits=0; total=0; nextrec=cap*period_mult
    def binof(a): return min(a//w,BINS-1)
    def recompute():
        th=sum(map(sum,H)); te=sum(map(sum,E))
        if th+te==0: return
        g=(th/(th+te))/cap
        v0=[0.0]*NC
        for it in range(2):
            for c in range(NC-1,-1,-1):
                cn=min(c+1,NC-1)
                hv=1+(v0[cn] if chain else 0)
                hitsR=0.0; evR=0.0; lifeR=0.0
                for a in range(BINS-1,-1,-1):
                    # moving down one bin adds w time to all events above
                    lifeR+= w*(hitsR+evR)
                    hitsR+=H[c][a]; evR+=E[c][a]
                    lifeR+= 0.5*w*(H[c][a]+E[c][a])
                    ev=hitsR+evR
                    V[c][a]= (hitsR*hv - g*lifeR)/ev if ev>0 else -1e9 if a>0 else 0
                v0[c]=V[c][0]
        for c in range(NC):
            for a in range(BINS): H[c][a]*=decay; E[c][a]*=decay
    for r in reqs:
        n=len(r); total+=n
        h=0
        while h<n and r[h] in where: h+=1
        hits+=h
        rs=set(r)
        # accesses of resident blocks (hits and gap hits): record hit event
        for b in r:
            if b in where:
                c=where[b]; a=clock-t_last[b]
                H[c][binof(a)]+=1
                del lists[c][b]; del where[b]
        clock+=n
        if clock>=nextrec:
            recompute(); nextrec=clock+cap*period_mult
        # eviction: need slots for request's non-resident blocks
        need=len(where)+n-cap
        while need>0:
            best=None
            for c in range(NC):
                L=lists[c]
                if not L: continue
                cands=[next(iter(L))]
                if ends: cands.append(next(reversed(L)))
                for b in cands:
                    a=clock-t_last[b]
                    v=V[c][binof(a)]
                    key=(v,-a)
                    if best is None or key<best[0]: best=(key,b,c,a)
            if best is None: break
            _,b,c,a=best
            del lists[c][b]; del where[b]
            E[c][binof(a)]+=1
            need-=1
        if need>0:
            for b in r: freq[b]+=1
            continue
        for k in range(n-1,-1,-1):
            b=r[k]
            c=min(freq[b],NC-1)
            lists[c][b]=1; where[b]=c; t_last[b]=clock
        for b in r: freq[b]+=1
    return hits/total
if __name__=='__main__':
    reqs=load(sys.argv[1])
    caps=[int(c) for c in sys.argv[2].split(',')]
    for cap in caps:
        print(cap, 'eva', round(100*run(reqs,cap),2), 'noends', round(100*run(reqs,cap,ends=False),2), flush=True)

"""New blocks of a request by the gap (in requests) since the last use of the deepest block it hit:\nP(reused within 800 requests) and P(ever reused); usage: python3 gap.py TRACE"""
import sys,collections
from model import load
reqs=load(sys.argv[1])
nxt={}; last={}
for i in range(len(reqs)-1,-1,-1):
    for k,b in enumerate(reqs[i]): nxt[(i,k)]=last.get(b)
    for b in reqs[i]: last[b]=i
seen={}   # block -> last request index
stat=collections.defaultdict(lambda:[0,0,0])
for i,r in enumerate(reqs):
    n=len(r); h=0
    while h<n and r[h] in seen: h+=1
    if h>=2:
        g=i-seen[r[h-1]]
        gb=min(g.bit_length(),12)
    else: gb=-1
    for k,b in enumerate(r):
        if b in seen: continue
        nu=nxt[(i,k)]
        s=stat[gb]; s[0]+=1
        if nu is not None and nu-i<=800: s[1]+=1
        if nu is not None: s[2]+=1
    for b in r: seen[b]=i
for gb in sorted(stat):
    a,b,c=stat[gb]; print('gap<2^%d'%gb if gb>=0 else 'fresh', a, 'P(reuse<=800)=%.2f'%(b/a), 'P(ever)=%.2f'%(c/a))

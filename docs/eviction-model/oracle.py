"""Oracle admission (admit a block iff it is used again within D requests) + LRU, in the
Python model; usage: python3 oracle.py TRACE"""
import sys,collections
from model import load,run
reqs=load(sys.argv[1])
# next-use (request index) per (i,k)
nxt={}
last={}
for i in range(len(reqs)-1,-1,-1):
    for k,b in enumerate(reqs[i]):
        nxt[(i,k)]=last.get(b)
    for b in reqs[i]: last[b]=i
# per (block, occurrence number): requests until its next use
occ=collections.Counter(); dist={}
for i,r in enumerate(reqs):
    for k,b in enumerate(r):
        nu=nxt[(i,k)]
        dist[(b,occ[b])]=None if nu is None else nu-i
        occ[b]+=1
for cap in [4096]:
    for D in [None,100,200,400,800,1600]:
        fn=(lambda f,k,n,h,b,D=D: dist[(b,f)] is not None and (D is None or dist[(b,f)]<=D))
        print(cap,'oracle D',D, round(100*run(reqs,cap,fn),2))

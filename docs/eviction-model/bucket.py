"""Hindsight-best per-feature-bucket admission: each bucket's probability of reuse within 800
requests is computed from the whole trace (an upper bound for any online per-bucket learner),
buckets at or above a threshold are admitted. usage: python3 bucket.py TRACE 1024,4096,16384"""
import sys,collections
from model import load,run
reqs=load(sys.argv[1])
caps=[int(c) for c in sys.argv[2].split(',')]
nxt={}; last={}
for i in range(len(reqs)-1,-1,-1):
    for k,b in enumerate(reqs[i]): nxt[(i,k)]=last.get(b)
    for b in reqs[i]: last[b]=i
occ=collections.Counter(); dist={}
freq=collections.Counter()
def bucket(f,k,n,h):
    return (min(f,4), n-1-k==0, min(h,32)//8 if f==0 else 0, min(k,64)//16, min(n,128)//32)
stat=collections.defaultdict(lambda:[0,0])
# h under infinite cache for bucket stats is different from model's h; use model-consistent h? approximate with infinite
for i,r in enumerate(reqs):
    n=len(r); h=0
    while h<n and freq[r[h]]>0: h+=1
    for k,b in enumerate(r):
        nu=nxt[(i,k)]
        s=stat[bucket(freq[b],k,n,h)]
        s[0]+=1
        if nu is not None and nu-i<=800: s[1]+=1
    for b in r: freq[b]+=1
p={k:v[1]/v[0] for k,v in stat.items()}
print(len(p),'buckets')
for cap in caps:
    res=[]
    for th in [0.15,0.2,0.25,0.3,0.35,0.4,0.5]:
        fn=lambda f,k,n,h,b,th=th: p.get(bucket(f,k,n,h),0)>=th
        res.append((th,round(100*run(reqs,cap,fn),2)))
    print(cap,res)

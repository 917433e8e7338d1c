"""The 196 feature buckets of bucket.py / hawkeye.py."""
def bucket(f, k, n, h):
    return (min(f, 4), n - 1 - k == 0, min(h, 32) // 8 if f == 0 else 0, min(k, 64) // 16, min(n, 128) // 32)

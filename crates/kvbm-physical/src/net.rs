//! Endpoints: whether one is on the loopback interface, parsed (an IP address, `localhost`),
//! never matched as text. One rule for every crate that decides on it: the S3 client (plain
//! `http` is refused off loopback unless allowed), the cluster plane's security defaults and
//! NATS credentials.

use std::net::SocketAddr;

/// Whether `endpoint` (`host:port`, a URL such as `nats://host:4222`, or a bare host) names
/// the loopback interface. Unresolvable names count as not loopback.
pub fn is_loopback(endpoint: &str) -> bool {
    let rest = endpoint.split("://").last().unwrap_or(endpoint);
    // Drop any userinfo and path.
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    let rest = rest.split('/').next().unwrap_or(rest);
    if let Ok(addr) = rest.parse::<SocketAddr>() {
        return addr.ip().is_loopback();
    }
    let host = match rest.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => rest,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<std::net::IpAddr>()
        .map(|ip| ip.is_loopback())
        .unwrap_or(false)
}

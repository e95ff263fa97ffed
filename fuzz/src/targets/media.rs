//! The gateway's reading of an image URL (`gateway::media::check_url`): what a request's
//! `image_url` may lead to before anything is resolved, connected or opened. Run under two
//! rule sets (the defaults with a local directory, and an allowlist); what it accepts must
//! keep the SSRF rules: an http(s) URL with a host, on the allowlist when there is one, a
//! public address when the host is an IP literal; a file path inside the directory with no `..`.

use std::net::IpAddr;
use std::path::{Component, PathBuf};

use ::gateway::media::{check_url, is_public, LocalDir, MediaRules, UrlTarget};

use super::text;
use crate::Outcome;

const DIR: &str = "/srv/images";

fn rule_sets() -> [MediaRules; 2] {
    let dir = PathBuf::from(DIR);
    let local = MediaRules {
        local_dir: Some(LocalDir {
            given: dir.clone(),
            resolved: dir,
        }),
        ..Default::default()
    };
    let allowlist = MediaRules {
        allowed_domains: vec!["images.example.com".into(), "127.0.0.1".into()],
        ..Default::default()
    };
    [local, allowlist]
}

/// An image URL, as text (invalid UTF-8 replaced, as JSON would not carry it).
pub fn image_url(data: &[u8]) -> Outcome {
    let url = String::from_utf8_lossy(data);
    let mut accepted = false;
    let mut last = Ok(());
    for rules in rule_sets() {
        match check_url(&url, &rules) {
            Ok(UrlTarget::Http(u)) => {
                accepted = true;
                assert!(matches!(u.scheme(), "http" | "https"), "{url:?} -> {u}");
                let host = u.host_str().unwrap_or_default();
                assert!(!host.is_empty(), "{url:?}: no host");
                if !rules.allowed_domains.is_empty() {
                    let name = host.to_ascii_lowercase();
                    assert!(
                        rules
                            .allowed_domains
                            .iter()
                            .any(|d| d == name.trim_end_matches('.')),
                        "{url:?}: {host} is not on the allowlist"
                    );
                }
                let literal = host.trim_start_matches('[').trim_end_matches(']');
                if let Ok(ip) = literal.parse::<IpAddr>() {
                    assert!(is_public(ip), "{url:?}: {ip} passed");
                }
            }
            Ok(UrlTarget::File(path)) => {
                accepted = true;
                assert!(path.starts_with(DIR), "{url:?} -> {}", path.display());
                assert!(
                    !path.components().any(|c| matches!(c, Component::ParentDir)),
                    "{url:?} -> {}",
                    path.display()
                );
            }
            Err(e) => last = Err(text(e)),
        }
    }
    if accepted {
        Ok(())
    } else {
        last
    }
}

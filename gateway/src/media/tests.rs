//! The fetch rules against a real HTTP server on loopback: the image served, redirects, a body
//! without end, a server that stalls, the allowlist, the cache, and `file://` inside and
//! outside the allowed directory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::*;

/// What the test server saw.
#[derive(Default)]
struct Seen {
    /// GETs of /cat.png and /no-store.png.
    image_requests: AtomicUsize,
    /// Bytes the endless body handed to the connection.
    endless_bytes_sent: AtomicUsize,
}

fn cat_png() -> Vec<u8> {
    std::fs::read(crate::tiny_fixture().join("images/cat.png")).unwrap()
}

fn redirect(to: String) -> Response {
    (StatusCode::FOUND, [(header::LOCATION, to)]).into_response()
}

/// A server on a loopback port; its base URL and what it saw.
async fn server() -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route(
            "/cat.png",
            get(|State(s): State<Arc<Seen>>| async move {
                s.image_requests.fetch_add(1, Ordering::SeqCst);
                ([(header::CONTENT_TYPE, "image/png")], cat_png())
            }),
        )
        .route(
            "/no-store.png",
            get(|State(s): State<Arc<Seen>>| async move {
                s.image_requests.fetch_add(1, Ordering::SeqCst);
                ([(header::CACHE_CONTROL, "private, no-store")], cat_png())
            }),
        )
        // /hops/N redirects N times, then to the image.
        .route(
            "/hops/{n}",
            get(|UrlPath(n): UrlPath<u32>| async move {
                match n {
                    0 => redirect("/cat.png".into()),
                    n => redirect(format!("/hops/{}", n - 1)),
                }
            }),
        )
        .route("/loop", get(|| async { redirect("/loop".into()) }))
        .route(
            "/to-file",
            get(|| async { redirect("file:///etc/passwd".into()) }),
        )
        .route(
            "/endless",
            get(|State(s): State<Arc<Seen>>| async move {
                let chunk = Bytes::from(vec![0x89u8; 64 * 1024]);
                let body = futures::stream::unfold(s, move |s| {
                    let chunk = chunk.clone();
                    async move {
                        s.endless_bytes_sent
                            .fetch_add(chunk.len(), Ordering::SeqCst);
                        Some((Ok::<_, std::io::Error>(chunk), s))
                    }
                });
                Body::from_stream(body)
            }),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                cat_png()
            }),
        )
        .route("/page.html", get(|| async { "<html>not an image</html>" }))
        .route("/missing", get(|| async { StatusCode::NOT_FOUND }))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

/// Rules for tests on loopback: private addresses allowed, short timeouts.
fn loopback_rules() -> MediaRules {
    MediaRules {
        allow_private_addresses: true,
        fetch_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

fn fetcher(rules: MediaRules) -> MediaFetcher {
    MediaFetcher::new(rules, Metrics::new())
}

const LIMIT: usize = 1 << 20;

async fn fetch(f: &MediaFetcher, url: &str) -> Result<Vec<u8>, String> {
    f.image(url, "messages[0].content[1]", LIMIT)
        .await
        .map_err(|e| {
            assert_eq!(e.http_status(), 400, "{e}");
            e.to_string()
        })
}

fn fetched(f: &MediaFetcher, outcome: &str) -> u64 {
    f.metrics.media_fetches.with_label_values(&[outcome]).get()
}

#[tokio::test]
async fn an_image_on_a_private_address_is_fetched_with_the_flag() {
    let (base, _) = server().await;
    let f = fetcher(loopback_rules());
    assert_eq!(
        fetch(&f, &format!("{base}/cat.png")).await.unwrap(),
        cat_png()
    );
    assert_eq!(fetched(&f, "ok"), 1);
    assert_eq!(f.metrics.media_fetch_bytes.get(), cat_png().len() as u64);
}

#[tokio::test]
async fn a_loopback_url_is_refused_by_default_naming_the_part_and_the_reason() {
    let (base, seen) = server().await;
    let f = fetcher(MediaRules::default());
    // An IP literal, refused before any connection...
    let e = fetch(&f, &format!("{base}/cat.png")).await.unwrap_err();
    assert!(
        e.contains("messages[0].content[1]")
            && e.contains("refused address")
            && e.contains("127.0.0.1"),
        "{e}"
    );
    // ...and a name, refused as resolved: the resolver hands the client no address.
    let by_name = base.replace("127.0.0.1", "localhost");
    let e = fetch(&f, &format!("{by_name}/cat.png")).await.unwrap_err();
    assert!(e.contains("refused address"), "{e}");
    assert!(e.contains("--allow-private-media-addresses"), "{e}");
    assert_eq!(seen.image_requests.load(Ordering::SeqCst), 0);
    assert_eq!(fetched(&f, "refused_address"), 2);
}

#[tokio::test]
async fn the_resolver_hands_over_public_addresses_only() {
    use reqwest::dns::Resolve;
    let name: reqwest::dns::Name = "localhost".parse().unwrap();
    let err = match PublicOnly.resolve(name).await {
        Ok(addrs) => panic!("localhost resolved to {:?}", addrs.collect::<Vec<_>>()),
        Err(e) => e,
    };
    assert!(err.downcast_ref::<RefusedAddress>().is_some(), "{err}");
}

#[test]
fn non_public_addresses_are_recognised_in_every_form() {
    for ip in [
        "0.0.0.0",
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.255",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "100.127.255.255",
        "192.0.2.1",
        "198.18.0.1",
        "198.51.100.7",
        "203.0.113.9",
        "224.0.0.1",
        "255.255.255.255",
        "::",
        "::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::127.0.0.1",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::1",
        "fc00::1",
        "fd12:3456::1",
        "fe80::1",
        "ff02::1",
        "2001:db8::1",
        "2001::1",
    ] {
        assert!(!is_public(ip.parse().unwrap()), "{ip} passed as public");
    }
    for ip in [
        "8.8.8.8",
        "1.1.1.1",
        "100.63.255.255",
        "100.128.0.1",
        "172.32.0.1",
        "2606:4700::1111",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",
    ] {
        assert!(is_public(ip.parse().unwrap()), "{ip} refused as non-public");
    }
}

#[tokio::test]
async fn three_redirects_are_followed_and_a_fourth_is_refused() {
    let (base, _) = server().await;
    let f = fetcher(loopback_rules());
    // /hops/2 -> /hops/1 -> /hops/0 -> /cat.png: three redirects.
    assert_eq!(
        fetch(&f, &format!("{base}/hops/2")).await.unwrap(),
        cat_png()
    );
    let e = fetch(&f, &format!("{base}/hops/3")).await.unwrap_err();
    assert!(e.contains("too many redirects"), "{e}");
    let e = fetch(&f, &format!("{base}/loop")).await.unwrap_err();
    assert!(e.contains("too many redirects"), "{e}");
    // A redirect may not leave http(s), even with a local directory allowed.
    let f = fetcher(MediaRules {
        local_dir: Some(LocalDir::new(Path::new("/etc")).unwrap()),
        ..loopback_rules()
    });
    let e = fetch(&f, &format!("{base}/to-file")).await.unwrap_err();
    assert!(e.contains("only http, https"), "{e}");
}

#[tokio::test]
async fn each_redirect_is_checked_again() {
    let (base, seen) = server().await;
    // Only "localhost" may be fetched from: its redirects to 127.0.0.1 are refused.
    let f = fetcher(MediaRules {
        allowed_domains: vec!["localhost".into()],
        ..loopback_rules()
    });
    let by_name = base.replace("127.0.0.1", "localhost");
    fetch(&f, &format!("{by_name}/cat.png")).await.unwrap();
    // A redirect from an allowed host to one that is not:
    let app = Router::new().route(
        "/away",
        get({
            let target = format!("{base}/cat.png");
            move || async move { redirect(target) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let before = seen.image_requests.load(Ordering::SeqCst);
    let e = fetch(&f, &format!("http://localhost:{port}/away"))
        .await
        .unwrap_err();
    assert!(e.contains("--allowed-media-domains"), "{e}");
    assert_eq!(seen.image_requests.load(Ordering::SeqCst), before);
}

#[tokio::test]
async fn a_body_over_the_limit_is_cut_off_without_being_read() {
    let (base, seen) = server().await;
    let f = fetcher(loopback_rules());
    // The body never ends: only stopping at the limit can answer.
    let e = tokio::time::timeout(
        Duration::from_secs(10),
        fetch(&f, &format!("{base}/endless")),
    )
    .await
    .expect("the fetch stops at the limit")
    .unwrap_err();
    assert!(
        e.contains("over the size limit") && e.contains(&LIMIT.to_string()),
        "{e}"
    );
    // What the server got out before the connection closed: the limit plus socket buffers.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let sent = seen.endless_bytes_sent.load(Ordering::SeqCst);
    assert!(sent < 64 * LIMIT, "the server sent {sent} bytes");
    assert_eq!(fetched(&f, "too_large"), 1);
}

#[tokio::test]
async fn a_server_that_stalls_hits_the_timeout() {
    let (base, _) = server().await;
    let f = fetcher(MediaRules {
        fetch_timeout: Duration::from_millis(300),
        ..loopback_rules()
    });
    let started = std::time::Instant::now();
    let e = fetch(&f, &format!("{base}/slow")).await.unwrap_err();
    assert!(e.contains("timeout"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(fetched(&f, "timeout"), 1);
}

#[tokio::test]
async fn a_page_a_missing_image_and_a_closed_port_are_refused_with_their_reason() {
    let (base, _) = server().await;
    let f = fetcher(loopback_rules());
    let e = fetch(&f, &format!("{base}/page.html")).await.unwrap_err();
    assert!(e.contains("not an image"), "{e}");
    let e = fetch(&f, &format!("{base}/missing")).await.unwrap_err();
    assert!(e.contains("HTTP 404"), "{e}");
    let e = fetch(&f, "http://127.0.0.1:1/cat.png").await.unwrap_err();
    assert!(e.contains("unreachable host"), "{e}");
}

#[tokio::test]
async fn the_allowlist_and_no_fetch_refuse_before_connecting() {
    let (base, seen) = server().await;
    let f = fetcher(MediaRules {
        allowed_domains: vec!["images.example.com".into()],
        ..loopback_rules()
    });
    let e = fetch(&f, &format!("{base}/cat.png")).await.unwrap_err();
    assert!(e.contains("--allowed-media-domains"), "{e}");
    let f = fetcher(MediaRules {
        fetch: false,
        ..loopback_rules()
    });
    let e = fetch(&f, &format!("{base}/cat.png")).await.unwrap_err();
    assert!(e.contains("--no-media-fetch"), "{e}");
    assert_eq!(seen.image_requests.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_url_sent_again_comes_from_the_cache_unless_no_store() {
    let (base, seen) = server().await;
    let f = fetcher(loopback_rules());
    for _ in 0..3 {
        assert_eq!(
            fetch(&f, &format!("{base}/cat.png")).await.unwrap(),
            cat_png()
        );
    }
    assert_eq!(seen.image_requests.load(Ordering::SeqCst), 1);
    assert_eq!(fetched(&f, "cached"), 2);
    for _ in 0..2 {
        fetch(&f, &format!("{base}/no-store.png")).await.unwrap();
    }
    assert_eq!(seen.image_requests.load(Ordering::SeqCst), 3);
    // No budget, no cache.
    let f = fetcher(MediaRules {
        cache_bytes: 0,
        ..loopback_rules()
    });
    fetch(&f, &format!("{base}/cat.png")).await.unwrap();
    fetch(&f, &format!("{base}/cat.png")).await.unwrap();
    assert_eq!(seen.image_requests.load(Ordering::SeqCst), 5);
}

#[test]
fn cache_control_decides_what_is_kept() {
    use reqwest::header::{HeaderMap, HeaderValue};
    let ttl = |v: &str| {
        let mut h = HeaderMap::new();
        h.insert(CACHE_CONTROL, HeaderValue::from_str(v).unwrap());
        cache_ttl(&h)
    };
    assert_eq!(cache_ttl(&HeaderMap::new()), Some(CACHE_TTL));
    assert_eq!(ttl("no-store"), None);
    assert_eq!(ttl("public, No-Cache"), None);
    assert_eq!(ttl("max-age=0"), None);
    assert_eq!(ttl("max-age=60"), Some(Duration::from_secs(60)));
    assert_eq!(ttl("max-age=999999"), Some(CACHE_TTL));
}

/// A fresh directory under the system's temporary one.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vlm-media-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn file_urls_are_read_inside_the_allowed_directory_only() {
    let root = temp_dir("file");
    let allowed = root.join("allowed");
    std::fs::create_dir_all(allowed.join("sub")).unwrap();
    std::fs::write(allowed.join("sub/cat.png"), cat_png()).unwrap();
    std::fs::write(root.join("secret.png"), cat_png()).unwrap();
    std::os::unix::fs::symlink(root.join("secret.png"), allowed.join("link.png")).unwrap();
    std::os::unix::fs::symlink(&root, allowed.join("up")).unwrap();
    let url = |p: &Path| format!("file://{}", p.display());

    // Off unless a directory is named.
    let f = fetcher(MediaRules::default());
    let e = fetch(&f, &url(&allowed.join("sub/cat.png")))
        .await
        .unwrap_err();
    assert!(e.contains("--allowed-local-media-path"), "{e}");

    let f = fetcher(MediaRules {
        local_dir: Some(LocalDir::new(&allowed).unwrap()),
        fetch: false, // file:// is not fetching
        ..MediaRules::default()
    });
    assert_eq!(
        fetch(&f, &url(&allowed.join("sub/cat.png"))).await.unwrap(),
        cat_png()
    );
    assert_eq!(
        fetch(&f, &format!("{}/sub/../sub/cat.png", url(&allowed)))
            .await
            .unwrap(),
        cat_png()
    );
    for outside in [
        url(&root.join("secret.png")),
        format!("{}/../secret.png", url(&allowed)),
        format!("{}/sub/%2e%2e/%2e%2e/secret.png", url(&allowed)),
        url(&allowed.join("link.png")),
        url(&allowed.join("up/secret.png")),
        "file:///etc/passwd".to_string(),
    ] {
        let e = fetch(&f, &outside).await.unwrap_err();
        assert!(
            e.contains("outside --allowed-local-media-path"),
            "{outside}: {e}"
        );
    }
    let e = fetch(&f, &url(&allowed.join("nothing.png")))
        .await
        .unwrap_err();
    assert!(e.contains("cannot read"), "{e}");
    let e = fetch(&f, "file://server.example.com/x.png")
        .await
        .unwrap_err();
    assert!(e.contains("host"), "{e}");
    // The byte limit holds for files too.
    let e = f
        .image(
            &url(&allowed.join("sub/cat.png")),
            "messages[0].content[0]",
            10,
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("over the size limit"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test]
async fn a_request_s_urls_are_fetched_into_their_parts() {
    let (base, seen) = server().await;
    let f = fetcher(loopback_rules());
    let mut messages = vec![Message::user(vec![
        Part::Text("two cats".into()),
        Part::Image(Vec::new()),
        Part::Image(Vec::new()),
    ])];
    let pending = (1..3)
        .map(|j| PendingImage {
            message: 0,
            part: j,
            url: format!("{base}/hops/{j}"),
            at: format!("messages[0].content[{j}]"),
        })
        .collect();
    f.resolve(&mut messages, pending, LIMIT).await.unwrap();
    for j in 1..3 {
        assert!(matches!(&messages[0].parts[j], Part::Image(b) if *b == cat_png()));
    }
    assert!(seen.image_requests.load(Ordering::SeqCst) >= 1);
}

#[tokio::test]
async fn fetches_past_the_limit_in_flight_get_429_at_once() {
    let (base, _) = server().await;
    let f = Arc::new(fetcher(MediaRules {
        max_concurrent_fetches: 1,
        fetch_timeout: Duration::from_secs(3),
        ..loopback_rules()
    }));
    let stalled = tokio::spawn({
        let f = f.clone();
        let url = format!("{base}/slow");
        async move { f.image(&url, "messages[0].content[0]", LIMIT).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let e = f
        .image(&format!("{base}/cat.png"), "messages[1].content[0]", LIMIT)
        .await
        .unwrap_err();
    assert_eq!(e.http_status(), 429, "{e}");
    assert!(
        e.to_string().contains("--media-max-concurrent-fetches"),
        "{e}"
    );
    stalled.abort();
}

#[test]
fn urls_are_checked_without_the_network_or_the_disk() {
    let dir = PathBuf::from("/srv/images");
    let rules = MediaRules {
        local_dir: Some(LocalDir {
            given: dir.clone(),
            resolved: dir,
        }),
        ..Default::default()
    };
    let refused = |url: &str| match check_url(url, &rules) {
        Err(FetchError::RefusedAddress(ip)) => ip.to_string(),
        other => panic!("{url}: {other:?}"),
    };
    // Every spelling of a non-public IP literal, as the URL parser reads it.
    assert_eq!(
        refused("http://169.254.169.254/latest/meta-data"),
        "169.254.169.254"
    );
    assert_eq!(
        refused("http://[::ffff:127.0.0.1]:8080/x"),
        "::ffff:127.0.0.1"
    );
    assert_eq!(refused("http://0x7f.1/x"), "127.0.0.1");
    assert_eq!(refused("http://2130706433/x"), "127.0.0.1");
    assert_eq!(refused("https://[fd00::1]/x"), "fd00::1");
    assert!(matches!(
        check_url("https://Example.com/cat.png?sig=1", &rules),
        Ok(UrlTarget::Http(_))
    ));
    assert!(matches!(
        check_url("file:///srv/images/a/../b.png", &rules),
        Ok(UrlTarget::File(p)) if p == Path::new("/srv/images/b.png")
    ));
    for outside in [
        "file:///srv/images/../etc/passwd",
        "file:///srv/images-old/cat.png",
        "file:///etc/passwd",
    ] {
        assert!(
            matches!(check_url(outside, &rules), Err(FetchError::LocalRefused(_))),
            "{outside}"
        );
    }
    for bad in ["gopher://example.com/x", "http://", "not a url", "data:,x"] {
        assert!(
            matches!(check_url(bad, &rules), Err(FetchError::BadUrl(_))),
            "{bad}: {:?}",
            check_url(bad, &rules)
        );
    }
}

use super::client::*;
use super::server::*;
use super::wire::*;
use super::*;

const T: Duration = Duration::from_secs(5);

/// A raw socket that has completed the client side of the handshake with `secret`.
fn raw_handshake(addr: SocketAddr, secret: Option<&JobSecret>) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let nc = [3u8; NONCE_BYTES];
    s.write_all(&hello_bytes(&nc)).unwrap();
    let mut greeting = [0u8; 8 + NONCE_BYTES + PROOF_BYTES];
    s.read_exact(&mut greeting).unwrap();
    let mut ns = [0u8; NONCE_BYTES];
    ns.copy_from_slice(&greeting[8..8 + NONCE_BYTES]);
    s.write_all(&store_proof(secret, CLIENT_LABEL, &nc, &ns))
        .unwrap();
    let mut ok = [0u8; 1];
    s.read_exact(&mut ok).unwrap();
    assert_eq!(ok[0], AUTH_OK);
    s
}

fn secret(text: &str) -> JobSecret {
    JobSecret::from_bytes(text.as_bytes().to_vec()).unwrap()
}

#[test]
fn clients_without_the_secret_are_refused_and_the_job_carries_on() {
    let server = TcpStoreServer::bind_with_secret("127.0.0.1:0", Some(secret("right"))).unwrap();
    assert!(server.is_authenticated());
    let good =
        TcpStore::connect_with_secret(server.local_addr(), T, Some(secret("right"))).unwrap();
    good.set("k", b"v").unwrap();
    for wrong in [Some(secret("wrong")), None] {
        let refused = TcpStore::connect_with_secret(server.local_addr(), T, wrong);
        assert!(
            matches!(
                refused,
                Err(Error::Protocol {
                    violation: ProtocolViolation::AuthenticationFailed,
                    ..
                })
            ),
            "{refused:?}"
        );
    }
    // A raw client that answers the challenge with a made-up proof is told AUTH_REFUSED
    // and disconnected, and nothing it sends afterwards reaches the store.
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    raw.write_all(&hello_bytes(&[1u8; NONCE_BYTES])).unwrap();
    let mut greeting = [0u8; 8 + NONCE_BYTES + PROOF_BYTES];
    raw.read_exact(&mut greeting).unwrap();
    raw.write_all(&[0u8; PROOF_BYTES]).unwrap();
    let mut answer = [0u8; 1];
    raw.read_exact(&mut answer).unwrap();
    assert_eq!(answer[0], AUTH_REFUSED);
    let mut req = vec![OP_SET];
    put_bytes(&mut req, b"intruder", MAX_KEY_BYTES).unwrap();
    put_bytes(&mut req, b"x", MAX_VALUE_BYTES).unwrap();
    let _ = raw.write_all(&req);
    let mut buf = [0u8; 8];
    assert!(matches!(raw.read(&mut buf), Ok(0) | Err(_)));
    // The authenticated client still works and the store holds only its key.
    assert_eq!(good.get("k", T).unwrap(), b"v");
    assert_eq!(server.store().num_keys().unwrap(), 1);
}

#[test]
fn a_client_with_a_secret_refuses_a_server_without_one() {
    let server = TcpStoreServer::bind_with_secret("127.0.0.1:0", None).unwrap();
    assert!(!server.is_authenticated());
    let result = TcpStore::connect_with_secret(server.local_addr(), T, Some(secret("s")));
    assert!(matches!(
        result,
        Err(Error::Protocol {
            violation: ProtocolViolation::AuthenticationFailed,
            ..
        })
    ));
}

#[test]
fn hello_prefixes_never_panic_and_name_what_is_wrong() {
    let mut good = [0u8; 8];
    good.copy_from_slice(&hello_bytes(&[0u8; NONCE_BYTES])[..8]);
    assert_eq!(check_hello_prefix(&good), Ok(()));
    let mut bad_magic = good;
    bad_magic[0] ^= 0xff;
    assert!(matches!(
        check_hello_prefix(&bad_magic),
        Err(ProtocolViolation::BadMagic { .. })
    ));
    let mut old = good;
    old[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert_eq!(
        check_hello_prefix(&old),
        Err(ProtocolViolation::VersionMismatch {
            ours: STORE_PROTOCOL_VERSION,
            theirs: 1
        })
    );
}

fn server_and_client() -> (TcpStoreServer, TcpStore) {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let client = TcpStore::connect(server.local_addr(), T).unwrap();
    (server, client)
}

#[test]
fn every_op_round_trips() {
    let (_server, store) = server_and_client();
    store.set("a", b"hello").unwrap();
    assert_eq!(store.get("a", T).unwrap(), b"hello");
    store.set("empty", b"").unwrap();
    assert_eq!(store.get("empty", T).unwrap(), b"");
    assert!(store.check(&["a", "empty"]).unwrap());
    assert!(!store.check(&["a", "missing"]).unwrap());
    store.wait(&["a", "empty"], T).unwrap();
    assert_eq!(store.add("n", 5).unwrap(), 5);
    assert_eq!(store.add("n", -7).unwrap(), -2);
    assert_eq!(store.get("n", T).unwrap(), b"-2");
    assert!(matches!(
        store.add("a", 1),
        Err(Error::StoreNotACounter { key }) if key == "a"
    ));
    // compare_set: a missing key with empty expected is set; a wrong expected is not.
    assert_eq!(store.compare_set("c", b"", b"one").unwrap(), b"one");
    assert_eq!(store.compare_set("c", b"zzz", b"two").unwrap(), b"one");
    assert_eq!(store.compare_set("c", b"one", b"two").unwrap(), b"two");
    assert_eq!(store.num_keys().unwrap(), 4);
    assert!(store.delete("c").unwrap());
    assert!(!store.delete("c").unwrap());
    assert_eq!(store.num_keys().unwrap(), 3);
    let big = vec![0xabu8; 1 << 20];
    store.set("big", &big).unwrap();
    assert_eq!(store.get("big", T).unwrap(), big);
}

#[test]
fn wait_and_get_time_out_with_the_missing_keys() {
    let (_server, store) = server_and_client();
    store.set("here", b"x").unwrap();
    let short = Duration::from_millis(120);
    let started = Instant::now();
    match store.wait(&["here", "absent"], short) {
        Err(Error::StoreTimeout { keys, after }) => {
            assert_eq!(keys, vec!["absent".to_string()]);
            assert_eq!(after, short);
        }
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    assert!(started.elapsed() >= short);
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(matches!(
        store.get("absent", short),
        Err(Error::StoreTimeout { .. })
    ));
    // The connection stays usable after a timeout.
    assert_eq!(store.get("here", T).unwrap(), b"x");
}

#[test]
fn get_waits_for_a_writer_on_the_same_client() {
    let (_server, store) = server_and_client();
    let store = Arc::new(store);
    let writer = {
        let store = store.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            store.set("late", b"v").unwrap();
        })
    };
    assert_eq!(store.get("late", T).unwrap(), b"v");
    writer.join().unwrap();
}

#[test]
fn concurrent_clients_count_exactly() {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            thread::spawn(move || {
                let store = TcpStore::connect(addr, T).unwrap();
                for _ in 0..50 {
                    store.add("counter", t + 1).unwrap();
                }
                store.set(&format!("done/{t}"), b"1").unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let store = TcpStore::connect(addr, T).unwrap();
    store
        .wait(&["done/0", "done/1", "done/2", "done/3"], T)
        .unwrap();
    // Thread t adds (t + 1) fifty times: 50 * (1 + 2 + 3 + 4).
    assert_eq!(store.add("counter", 0).unwrap(), 500);
    assert_eq!(server.store().num_keys().unwrap(), 5);
}

#[test]
fn garbage_client_is_dropped_and_others_carry_on() {
    let (server, store) = server_and_client();
    store.set("k", b"v").unwrap();

    // A client with the wrong magic is disconnected.
    let mut bad = TcpStream::connect(server.local_addr()).unwrap();
    bad.set_read_timeout(Some(T)).unwrap();
    bad.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut buf = [0u8; 16];
    assert!(matches!(bad.read(&mut buf), Ok(0) | Err(_)));

    // A client with a good handshake that then claims a huge value is disconnected
    // without the server allocating it.
    let mut liar = raw_handshake(server.local_addr(), None);
    let mut req = vec![OP_SET];
    put_bytes(&mut req, b"x", MAX_KEY_BYTES).unwrap();
    put_u32(&mut req, u32::MAX);
    liar.write_all(&req).unwrap();
    assert!(matches!(liar.read(&mut buf), Ok(0) | Err(_)));

    // An unknown opcode is disconnected too.
    let mut odd = raw_handshake(server.local_addr(), None);
    odd.write_all(&[0xee, 1, 2, 3]).unwrap();
    assert!(matches!(odd.read(&mut buf), Ok(0) | Err(_)));

    assert_eq!(store.get("k", T).unwrap(), b"v");
    assert_eq!(server.store().num_keys().unwrap(), 1);
}

#[test]
fn wrong_version_is_a_protocol_error_for_the_client() {
    // A fake server that answers with version 99.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 8 + NONCE_BYTES];
        s.read_exact(&mut hello).unwrap();
        let mut reply = STORE_MAGIC.to_le_bytes().to_vec();
        reply.extend_from_slice(&99u32.to_le_bytes());
        s.write_all(&reply).unwrap();
    });
    let result = TcpStore::connect(addr, T);
    assert!(matches!(
        result,
        Err(Error::Protocol {
            violation: ProtocolViolation::VersionMismatch {
                ours: STORE_PROTOCOL_VERSION,
                theirs: 99
            },
            ..
        })
    ));
    fake.join().unwrap();
}

#[test]
fn oversized_key_is_refused_before_sending() {
    let (_server, store) = server_and_client();
    let key = "k".repeat(MAX_KEY_BYTES + 1);
    assert!(matches!(
        store.set(&key, b"v"),
        Err(Error::Protocol {
            violation: ProtocolViolation::FrameTooLarge { .. },
            ..
        })
    ));
    assert_eq!(store.num_keys().unwrap(), 0);
}

#[test]
fn dropping_the_server_closes_clients_promptly() {
    let (server, store) = server_and_client();
    store.set("k", b"v").unwrap();
    let started = Instant::now();
    drop(server);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(store.get("k", Duration::from_millis(100)).is_err());
}

//! The accepting side of the mesh handshake: never admits a peer without a right HMAC proof, never
//! writes more than one challenge.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    assert!(
        !hypershard_collectives::fuzzing::mesh_acceptor(data),
        "admitted without the secret"
    );
});

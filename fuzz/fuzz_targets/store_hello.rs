//! The first bytes of a Store connection (magic and version).
#![no_main]

use hypershard_collectives::fuzzing::store_hello;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    store_hello(data);
});

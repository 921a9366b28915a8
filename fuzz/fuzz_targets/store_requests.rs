//! Store requests of an authenticated client: served or refused, never a panic or an allocation
//! beyond the caps.
#![no_main]

use hypershard_collectives::fuzzing::store_requests;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    store_requests(data);
});

//! Copies a rank's output to the launcher's, one whole line at a time, prefixed `[rank N] `.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc::Sender;
use std::thread::JoinHandle;

/// Which of the launcher's streams a rank stream goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    /// The launcher's stdout.
    Stdout,
    /// The launcher's stderr.
    Stderr,
}

/// Prefixes every line of `reader` with `[rank N] ` and writes it to `sink`. Lines are written
/// whole under the stream's lock, so two ranks never interleave inside a line. Sends `()` on
/// `done` at end of stream, so the launcher can wait for the last lines with a deadline.
pub fn forward_lines(
    rank: usize,
    reader: impl Read + Send + 'static,
    sink: Sink,
    done: Sender<()>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("rank-{rank}-output"))
        .spawn(move || {
            let mut reader = BufReader::new(reader);
            let prefix = format!("[rank {rank}] ");
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if !line.ends_with(b"\n") {
                            line.push(b'\n');
                        }
                        let mut text = Vec::with_capacity(prefix.len() + line.len());
                        text.extend_from_slice(prefix.as_bytes());
                        text.extend_from_slice(&line);
                        // A closed launcher stream (e.g. `| head`) must not kill the copy
                        // loop: the rank would block on a full pipe.
                        let _ = match sink {
                            Sink::Stdout => std::io::stdout().lock().write_all(&text),
                            Sink::Stderr => std::io::stderr().lock().write_all(&text),
                        };
                    }
                }
            }
            let _ = done.send(());
        })
}

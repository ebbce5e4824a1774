//! Endpoint strings: `SCHEME://ADDRESS?incarnation=HEX`. Discovery publishes them; naming the
//! incarnation makes a connect from a stale record fail once the worker restarted.

use std::fmt;

use crate::region::Incarnation;
use crate::TransferError;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub scheme: String,
    pub address: String,
    /// The incarnation the peer must have; `None` accepts whichever answers.
    pub incarnation: Option<Incarnation>,
}

impl Endpoint {
    pub fn parse(s: &str) -> Result<Self, TransferError> {
        let bad = || TransferError::PeerGone(format!("malformed endpoint {s:?}"));
        let (scheme, rest) = s.split_once("://").ok_or_else(bad)?;
        let (address, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let incarnation = match query {
            None => None,
            Some(q) => {
                let hex = q.strip_prefix("incarnation=").ok_or_else(bad)?;
                Some(Incarnation(
                    u64::from_str_radix(hex, 16).map_err(|_| bad())?,
                ))
            }
        };
        if scheme.is_empty() || address.is_empty() {
            return Err(bad());
        }
        Ok(Endpoint {
            scheme: scheme.to_string(),
            address: address.to_string(),
            incarnation,
        })
    }

    /// Parses `s` as an endpoint of the backend named `scheme`.
    pub(crate) fn parse_for(s: &str, scheme: &str) -> Result<Self, TransferError> {
        let ep = Self::parse(s)?;
        if ep.scheme != scheme {
            return Err(TransferError::PeerGone(format!(
                "{s:?} is not a {scheme} endpoint"
            )));
        }
        Ok(ep)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.scheme, self.address)?;
        if let Some(i) = self.incarnation {
            write!(f, "?incarnation={i}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let e = Endpoint::parse("tcp://127.0.0.1:9000?incarnation=00000000000000ff").unwrap();
        assert_eq!(e.address, "127.0.0.1:9000");
        assert_eq!(e.incarnation, Some(Incarnation(255)));
        assert_eq!(Endpoint::parse(&e.to_string()).unwrap(), e);
        assert_eq!(Endpoint::parse("local://3").unwrap().incarnation, None);
        assert!(Endpoint::parse("127.0.0.1:9000").is_err());
        assert!(Endpoint::parse("tcp://h:1?inc=1").is_err());
    }
}

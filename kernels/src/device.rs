//! Naming a compute device: `cpu`, `cuda[:N]` or `hip[:N]`, as a `--device` flag would take it.
//! Always built, so a binary without the `cuda` or `hip` feature can still parse the name and
//! say which feature it lacks.

use std::fmt;
use std::str::FromStr;

/// A compute device: the CPU, or GPU `N` of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// NVIDIA GPU `N` (feature `cuda`).
    Cuda(usize),
    /// AMD GPU `N` (feature `hip`).
    Hip(usize),
}

/// Why a device name was refused, or why the named device cannot be used by this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device {0:?}: expected cpu, cuda[:N] or hip[:N]")]
    Unknown(String),
    #[error("bad device ordinal in {0:?}: expected a number after the colon, e.g. hip:0")]
    BadOrdinal(String),
    #[error("this build of tessera has no {backend} backend: rebuild with `--features {backend}`")]
    NotBuilt { backend: &'static str },
}

/// Parses `cpu`, `cuda`, `cuda:N`, `hip` or `hip:N` (case-insensitive; no ordinal means 0).
pub fn parse_device(s: &str) -> Result<Device, DeviceError> {
    let t = s.trim().to_ascii_lowercase();
    let (kind, ordinal) = match t.split_once(':') {
        Some((k, n)) => {
            let n = n
                .parse::<usize>()
                .map_err(|_| DeviceError::BadOrdinal(s.to_string()))?;
            (k, Some(n))
        }
        None => (t.as_str(), None),
    };
    match (kind, ordinal) {
        ("cpu", None) => Ok(Device::Cpu),
        ("cuda", n) => Ok(Device::Cuda(n.unwrap_or(0))),
        ("hip", n) => Ok(Device::Hip(n.unwrap_or(0))),
        _ => Err(DeviceError::Unknown(s.to_string())),
    }
}

impl FromStr for Device {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_device(s)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Hip(n) => write!(f, "hip:{n}"),
        }
    }
}

impl Device {
    /// The cargo feature the device's backend needs (`None` for the CPU).
    pub fn feature(&self) -> Option<&'static str> {
        match self {
            Device::Cpu => None,
            Device::Cuda(_) => Some("cuda"),
            Device::Hip(_) => Some("hip"),
        }
    }

    /// Whether this build contains the device's backend.
    pub fn is_built(&self) -> bool {
        match self {
            Device::Cpu => true,
            Device::Cuda(_) => cfg!(feature = "cuda"),
            Device::Hip(_) => cfg!(feature = "hip"),
        }
    }

    /// `Ok` when this build contains the device's backend, else an error naming the feature.
    pub fn check_built(&self) -> Result<(), DeviceError> {
        match self.feature() {
            Some(backend) if !self.is_built() => Err(DeviceError::NotBuilt { backend }),
            _ => Ok(()),
        }
    }

    /// Opens the device once to see that it is there: its description ("cpu", or the GPU's
    /// name and architecture), or why it cannot be used (backend not built, no driver, no such
    /// device) as a message for the user.
    pub fn probe(&self) -> Result<String, String> {
        self.check_built().map_err(|e| e.to_string())?;
        match *self {
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => crate::cuda::CudaDevice::open(n, None)
                .map(|d| format!("{} ({})", d.name(), d.arch()))
                .map_err(|e| e.to_string()),
            #[cfg(feature = "hip")]
            Device::Hip(n) => crate::hip::HipDevice::open(n, None)
                .map(|d| format!("{} ({})", d.name(), d.arch()))
                .map_err(|e| e.to_string()),
            // The CPU, and backends check_built already refused.
            _ => Ok(self.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!(parse_device("cpu"), Ok(Device::Cpu));
        assert_eq!(parse_device("hip"), Ok(Device::Hip(0)));
        assert_eq!(parse_device("HIP:3"), Ok(Device::Hip(3)));
        assert_eq!(parse_device("cuda"), Ok(Device::Cuda(0)));
        assert_eq!(" cuda:1 ".parse::<Device>(), Ok(Device::Cuda(1)));
        for d in [Device::Cpu, Device::Cuda(2), Device::Hip(7)] {
            assert_eq!(parse_device(&d.to_string()), Ok(d));
        }
    }

    #[test]
    fn probing_says_what_is_missing() {
        assert_eq!(Device::Cpu.probe(), Ok("cpu".to_string()));
        for d in [Device::Cuda(0), Device::Hip(0)] {
            match d.probe() {
                // A machine with that GPU (and its backend built).
                Ok(name) => assert!(!name.is_empty()),
                Err(msg) => assert!(
                    msg.contains("--features") || msg.contains("driver") || msg.contains("GPU"),
                    "{d}: unhelpful: {msg}"
                ),
            }
        }
        assert!(Device::Cuda(10_000).probe().is_err());
    }

    #[test]
    fn refuses_what_it_does_not_know() {
        assert!(matches!(parse_device("rocm"), Err(DeviceError::Unknown(_))));
        assert!(matches!(
            parse_device("cpu:0"),
            Err(DeviceError::Unknown(_))
        ));
        assert!(matches!(
            parse_device("hip:x"),
            Err(DeviceError::BadOrdinal(_))
        ));
        assert!(matches!(
            parse_device("hip:"),
            Err(DeviceError::BadOrdinal(_))
        ));
        assert!(parse_device("vulkan")
            .unwrap_err()
            .to_string()
            .contains("hip[:N]"));
    }

    #[test]
    fn says_which_feature_is_missing() {
        assert_eq!(Device::Cpu.check_built(), Ok(()));
        assert_eq!(Device::Hip(0).is_built(), cfg!(feature = "hip"));
        if !cfg!(feature = "hip") {
            let e = Device::Hip(0).check_built().unwrap_err().to_string();
            assert!(e.contains("--features hip"), "{e}");
        }
    }
}

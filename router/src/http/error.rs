//! The one error type of the HTTP front, and the only place errors become status codes and
//! OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::backend::BackendError;

/// An error on its way to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The offending request field, when there is one.
    pub param: Option<String>,
    /// OpenAI's machine-readable `code` (`model_not_found`, `context_length_exceeded`, …).
    pub code: Option<&'static str>,
    /// Seconds the client should wait before retrying (`Retry-After`), for 429s.
    pub retry_after: Option<u64>,
}

/// Set on the response of every refused request, for the metrics middleware: the status and
/// [`ApiError::reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub status: u16,
    pub reason: &'static str,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request is malformed or asks for something out of range.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 400 naming the offending field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param)
    }

    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
        )
        .with_param("model");
        e.code = Some("model_not_found");
        e
    }

    pub fn route_not_found(method: &str, path: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            format!("Unknown route {method} {path}"),
        );
        e.code = Some("not_found");
        e
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("Method {method} is not allowed for {path}"),
        )
    }

    /// 401: no API key, or not one of the configured keys.
    pub fn unauthorized(message: impl Into<String>, code: &'static str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message).with_code(code)
    }

    /// 429: the client's rate limit is spent; it may retry after `retry_after` seconds.
    pub fn rate_limited(retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("Rate limit reached for this API key or client. Retry after {retry_after} s."),
        )
        .with_code("rate_limit_exceeded");
        e.retry_after = Some(retry_after);
        e
    }

    /// 400: the prompt does not fit the model's context or the server's prompt limit.
    pub fn prompt_too_long(message: impl Into<String>) -> Self {
        Self::invalid_param("prompt", message).with_code("context_length_exceeded")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// OpenAI's error `type` for this status.
    pub fn error_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            429 => "rate_limit_error",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// Why a request was refused, for the metrics: the `code` when there is one, else a name
    /// for the status.
    pub fn reason(&self) -> &'static str {
        self.code.unwrap_or(match self.status.as_u16() {
            400 => "invalid_request",
            401 => "unauthenticated",
            404 => "not_found",
            405 => "method_not_allowed",
            413 => "request_too_large",
            429 => "rate_limited",
            _ => "other",
        })
    }

    /// The JSON body OpenAI clients expect.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!(ErrorBody {
            error: ErrorObject {
                message: &self.message,
                r#type: self.error_type(),
                param: self.param.as_deref(),
                code: self.code,
            }
        })
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    message: &'a str,
    r#type: &'static str,
    param: Option<&'a str>,
    code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, message = %self.message, "request failed");
        } else {
            tracing::debug!(status = %self.status, message = %self.message, "request rejected");
        }
        let mut response = (self.status, Json(self.body())).into_response();
        let headers = response.headers_mut();
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.status.is_client_error() {
            response.extensions_mut().insert(Refused {
                status: self.status.as_u16(),
                reason: self.reason(),
            });
        }
        response
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        let message = e.to_string();
        match e {
            BackendError::Overloaded(_) => {
                let mut e =
                    Self::new(StatusCode::TOO_MANY_REQUESTS, message).with_code("overloaded");
                e.retry_after = Some(1);
                e
            }
            BackendError::InvalidRequest(_) => Self::invalid(message),
            BackendError::PromptTooLong { .. } => Self::prompt_too_long(message),
            BackendError::Unavailable(_) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, message).with_code("service_unavailable")
            }
            BackendError::Internal(_) => Self::internal(message),
        }
    }
}

/// A JSON body extractor whose every rejection is an [`ApiError`]: 413 past the body limit,
/// 400 with serde's message (and the failing field as `param`) for anything malformed. The
/// `Content-Type` header is not checked, as many OpenAI clients are sloppy with it.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            let status = rej.status();
            let mut e = ApiError::new(status, rej.body_text());
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                e.message = "Request body is too large".into();
                e.code = Some("request_too_large");
            }
            e
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// Parse a request body as JSON, turning syntax errors into 400s.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid(format!("Invalid JSON in request body: {inner}"))
        } else {
            field_error(&path, &inner)
        }
    })
}

/// Read a parsed body as `T`, turning type errors into 400s that name the field.
pub fn parse_value<T: DeserializeOwned>(value: &serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        field_error(&path, err.inner())
    })
}

fn field_error(path: &str, inner: &serde_json::Error) -> ApiError {
    if path == "." {
        ApiError::invalid(format!("Invalid request body: {inner}"))
    } else {
        ApiError::invalid_param(path, format!("Invalid value for `{path}`: {inner}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Req {
        #[allow(dead_code)]
        temperature: Option<f32>,
    }

    #[test]
    fn json_errors_name_the_field() {
        let e = parse_json::<Req>(br#"{"temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = parse_json::<Req>(b"{\"temperature\": ").unwrap_err();
        assert!(e.message.starts_with("Invalid JSON"), "{}", e.message);
        let e = parse_json::<Req>(b"\"warm\"").unwrap_err();
        assert_eq!(e.param, None);
        let v = serde_json::json!({"temperature": [1]});
        let e = parse_value::<Req>(&v).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
    }

    #[test]
    fn backend_errors_map_to_statuses() {
        let cases = [
            (
                BackendError::Overloaded("q".into()),
                429,
                "rate_limit_error",
            ),
            (
                BackendError::InvalidRequest("x".into()),
                400,
                "invalid_request_error",
            ),
            (
                BackendError::PromptTooLong {
                    prompt_tokens: 9,
                    limit: 8,
                },
                400,
                "invalid_request_error",
            ),
            (BackendError::Unavailable("x".into()), 503, "server_error"),
            (BackendError::Internal("x".into()), 500, "server_error"),
        ];
        for (b, status, ty) in cases {
            let e = ApiError::from(b);
            assert_eq!(e.status.as_u16(), status);
            assert_eq!(e.body()["error"]["type"], ty);
        }
    }
}

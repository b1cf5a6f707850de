// libinferd for C++ (C++17): RAII owners of the C handles of inferd.h, exceptions for
// failures, and std::span-style views of outputs read in place. Header only; link with
// -linferd (pkg-config --cflags --libs inferd).
//
//   inferd::Client client;                                  // $INFERD_SOCKET or the default
//   std::vector<float> image(1 * 3 * 48 * 192);
//   inferd::Call call = client.infer("ocr-cls");
//   call.input("x", image, {1, 3, 48, 192}).run();          // throws inferd::Error
//   inferd::Tensor y = call.output(0);
//   float first = y.at<float>(0);                           // an unaligned-safe read
//
// Threads as in C: a Client and its Calls belong to one thread at a time.
#ifndef INFERD_HPP
#define INFERD_HPP

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "inferd.h"

namespace inferd {

// A failed step: the code and the message that came with it.
class Error : public std::runtime_error {
public:
    Error(inferd_code code, const std::string &message)
        : std::runtime_error(std::string(inferd_code_name(code)) + ": " + message), code_(code) {}
    inferd_code code() const noexcept { return code_; }

private:
    inferd_code code_;
};

// A read-only view of N elements (std::span's shape, for C++17).
template <class T> class View {
public:
    constexpr View() noexcept = default;
    constexpr View(const T *data, std::size_t size) noexcept : data_(data), size_(size) {}
    constexpr const T *data() const noexcept { return data_; }
    constexpr std::size_t size() const noexcept { return size_; }
    constexpr bool empty() const noexcept { return size_ == 0; }
    constexpr const T *begin() const noexcept { return data_; }
    constexpr const T *end() const noexcept { return data_ + size_; }
    constexpr const T &operator[](std::size_t i) const noexcept { return data_[i]; }

private:
    const T *data_ = nullptr;
    std::size_t size_ = 0;
};

// The wire dtype of a C++ element type.
template <class T> struct dtype_of;
#define INFERD_DTYPE_OF(type, value) \
    template <> struct dtype_of<type> { static constexpr inferd_dtype dtype = value; }
INFERD_DTYPE_OF(bool, INFERD_BOOL);
INFERD_DTYPE_OF(std::int8_t, INFERD_INT8);
INFERD_DTYPE_OF(std::uint8_t, INFERD_UINT8);
INFERD_DTYPE_OF(std::int16_t, INFERD_INT16);
INFERD_DTYPE_OF(std::uint16_t, INFERD_UINT16);
INFERD_DTYPE_OF(std::int32_t, INFERD_INT32);
INFERD_DTYPE_OF(std::uint32_t, INFERD_UINT32);
INFERD_DTYPE_OF(std::int64_t, INFERD_INT64);
INFERD_DTYPE_OF(std::uint64_t, INFERD_UINT64);
INFERD_DTYPE_OF(float, INFERD_FLOAT32);
INFERD_DTYPE_OF(double, INFERD_FLOAT64);
#undef INFERD_DTYPE_OF

// An output tensor, in place in the received frame (valid while its Call lives). The
// frame is not aligned: read elements with at<T>() or copy_to(), or use aligned<T>().
class Tensor {
public:
    explicit Tensor(const inferd_tensor *t, inferd_call *call, std::size_t index)
        : t_(t), call_(call), index_(index) {}
    std::string_view name() const { return t_->name; }
    inferd_dtype dtype() const { return t_->dtype; }
    View<std::int64_t> shape() const { return {t_->shape, t_->rank}; }
    View<unsigned char> bytes() const {
        return {static_cast<const unsigned char *>(t_->data), t_->size};
    }
    std::uint64_t elements() const {
        std::uint64_t n = 0;
        inferd_shape_elements(t_->shape, t_->rank, &n);
        return n;
    }
    // Element I (C order), copied out: safe at any alignment.
    template <class T> T at(std::uint64_t i) const {
        check<T>();
        if (i >= elements())
            throw std::out_of_range("inferd::Tensor::at");
        T value;
        std::memcpy(&value, static_cast<const unsigned char *>(t_->data) + i * sizeof(T),
                    sizeof(T));
        return value;
    }
    // Every element as a View at an aligned address (a copy owned by the Call when the
    // frame itself is not aligned).
    template <class T> View<T> aligned() const {
        check<T>();
        const void *p = inferd_output_aligned(call_, index_);
        if (p == nullptr && t_->size != 0)
            throw Error(INFERD_NO_MEMORY, "no aligned copy of output " + std::string(name()));
        return {static_cast<const T *>(p), static_cast<std::size_t>(elements())};
    }
    template <class T> std::vector<T> copy() const {
        check<T>();
        std::vector<T> out(static_cast<std::size_t>(elements()));
        if (t_->size)
            std::memcpy(out.data(), t_->data, t_->size);
        return out;
    }
    // Element I of a string tensor, in place.
    std::string_view string(std::uint64_t i) const {
        const char *data;
        std::size_t len;
        inferd_code rc = inferd_output_string(call_, index_, i, &data, &len);
        if (rc != INFERD_OK)
            throw Error(rc, "no string element " + std::to_string(i) + " in " + std::string(name()));
        return {data, len};
    }

private:
    template <class T> void check() const {
        if (t_->dtype != dtype_of<T>::dtype)
            throw Error(INFERD_INVALID_ARGUMENT, "output " + std::string(name()) + " is " +
                                                     inferd_dtype_name(t_->dtype));
    }
    const inferd_tensor *t_;
    inferd_call *call_;
    std::size_t index_;
};

// Owns one C handle: move-only, released by FREE (which takes nullptr) when it goes.
template <class T, void (*Free)(T *)> class Handle {
public:
    Handle() noexcept = default;
    explicit Handle(T *p) noexcept : p_(p) {}
    Handle(Handle &&other) noexcept : p_(std::exchange(other.p_, nullptr)) {}
    Handle &operator=(Handle &&other) noexcept {
        if (this != &other) {
            Free(p_);
            p_ = std::exchange(other.p_, nullptr);
        }
        return *this;
    }
    Handle(const Handle &) = delete;
    Handle &operator=(const Handle &) = delete;
    ~Handle() { Free(p_); }
    T *get() const noexcept { return p_; }
    // Where a C constructor writes the new handle (only while this one is empty).
    T **out() noexcept { return &p_; }

private:
    T *p_ = nullptr;
};

// A shared-memory region of a client (see inferd.h); owns its inferd_region. Inputs
// placed in data() travel by reference; Call::outputs_into has outputs written here.
class Region {
public:
    Region(inferd_client *client, std::size_t size) {
        inferd_code rc = inferd_region_new(client, size, region_.out());
        if (rc != INFERD_OK)
            throw Error(rc, inferd_client_error(client));
    }
    void *data() const noexcept { return inferd_region_data(get()); }
    std::size_t size() const noexcept { return inferd_region_size(get()); }
    inferd_region *get() const noexcept { return region_.get(); }

private:
    Handle<inferd_region, inferd_region_free> region_;
};

// One request and its reply; owns its inferd_call.
class Call {
public:
    explicit Call(inferd_call *call) : call_(call) {
        if (call == nullptr)
            throw Error(INFERD_NO_MEMORY, "out of memory for a call");
    }

    // An input, borrowed: DATA must stay valid until the call completes.
    Call &input(const std::string &name, inferd_dtype dtype, View<std::int64_t> shape,
                const void *data, std::size_t size) {
        inferd_tensor t{name.c_str(), dtype, shape.size(), shape.data(), data, size, nullptr,
                        nullptr};
        check(inferd_call_add_input(get(), &t), "input " + name);
        return *this;
    }
    template <class T>
    Call &input(const std::string &name, const std::vector<T> &values,
                std::initializer_list<std::int64_t> shape) {
        return input(name, dtype_of<T>::dtype, View<std::int64_t>(shape.begin(), shape.size()),
                     values.data(), values.size() * sizeof(T));
    }
    // Asks for output NAME only (repeatable; default every output).
    Call &only_output(const std::string &name) {
        check(inferd_call_add_output(get(), name.c_str()), "output " + name);
        return *this;
    }
    Call &timeout_ms(std::int64_t ms) {
        check(inferd_call_set_timeout(get(), ms), "timeout");
        return *this;
    }
    Call &version(std::int64_t v) {
        check(inferd_call_set_version(get(), v), "version");
        return *this;
    }
    // The numeric outputs written into SIZE bytes of REGION from OFFSET.
    Call &outputs_into(Region &region, std::uint64_t offset, std::uint64_t size) {
        check(inferd_call_set_outputs_into(get(), region.get(), offset, size), "outputs_into");
        return *this;
    }
    Call &param(const std::string &key, const std::string &json) {
        check(inferd_call_set_param(get(), key.c_str(), json.c_str()), "param " + key);
        return *this;
    }
    // The header's "stream" field (inferd_call_set_stream; libinferd 0.2).
    Call &stream(const std::string &id, bool start, bool end = false) {
        check(inferd_call_set_stream(get(), id.c_str(), start, end), "stream " + id);
        return *this;
    }

    void submit() { check(inferd_submit(get()), "submit"); }
    // Waits up to TIMEOUT_MS (< 0: the call's deadline): true when it completed
    // successfully, false if still in flight; throws Error if it failed.
    bool wait(std::int64_t timeout_ms = -1) {
        inferd_code rc = inferd_wait(get(), timeout_ms);
        if (rc == INFERD_AGAIN)
            return false;
        if (rc != INFERD_OK)
            throw Error(rc, inferd_call_message(get()));
        return true;
    }
    // submit() then wait() until it completes.
    Call &run() {
        submit();
        wait();
        return *this;
    }

    inferd_code code() const { return inferd_call_code(get()); }
    std::string_view message() const { return inferd_call_message(get()); }
    std::string_view id() const { return inferd_call_id(get()); }
    // The result of a control op as JSON text ("" if none).
    std::string_view result() const {
        const char *r = inferd_call_result(get());
        return r ? r : "";
    }
    std::size_t outputs() const { return inferd_output_count(get()); }
    Tensor output(std::size_t i) const {
        const inferd_tensor *t = inferd_output(get(), i);
        if (t == nullptr)
            throw std::out_of_range("inferd::Call::output");
        return Tensor(t, get(), i);
    }
    Tensor output(const std::string &name) const {
        for (std::size_t i = 0; i < outputs(); i++)
            if (name == inferd_output(get(), i)->name)
                return output(i);
        throw Error(INFERD_NOT_FOUND, "no output " + name);
    }
    inferd_call *get() const noexcept { return call_.get(); }

private:
    void check(inferd_code rc, const std::string &what) {
        if (rc == INFERD_OK)
            return;
        // a completed call carries its message; a refused step, the client's
        const char *m = inferd_call_code(get()) != INFERD_AGAIN
                            ? inferd_call_message(get())
                            : inferd_client_error(inferd_call_client(get()));
        throw Error(rc, what + (m && *m ? std::string(": ") + m : std::string()));
    }
    Handle<inferd_call, inferd_call_free> call_;
};

// One connection; owns its inferd_client.
class Client {
public:
    // ENDPOINT nullptr: $INFERD_SOCKET, else the system socket. Throws Error.
    explicit Client(const char *endpoint = nullptr, void *zmq_context = nullptr) {
        inferd_code rc = inferd_client_new(client_.out(), endpoint, zmq_context);
        if (rc != INFERD_OK)
            throw Error(rc, inferd_client_error(get()));  // client_ frees it
    }

    Client &set(inferd_option option, std::int64_t value) {
        inferd_code rc = inferd_client_set(get(), option, value);
        if (rc != INFERD_OK)
            throw Error(rc, inferd_client_error(get()));
        return *this;
    }
    Call call(inferd_op op, const char *model = nullptr) {
        return Call(inferd_call_new(get(), op, model));
    }
    Call infer(const std::string &model) { return call(INFERD_OP_INFER, model.c_str()); }
    // A control op, run: its result as JSON text.
    std::string control(inferd_op op, const char *model = nullptr) {
        return std::string(call(op, model).run().result());
    }
    bool ping() {
        int ready = 0;
        inferd_code rc = inferd_ping(get(), &ready);
        if (rc != INFERD_OK)
            throw Error(rc, inferd_client_error(get()));
        return ready != 0;
    }
    bool connected() { return inferd_client_connected(get()) != 0; }
    Region region(std::size_t size) { return Region(get(), size); }
    inferd_client *get() const noexcept { return client_.get(); }

private:
    Handle<inferd_client, inferd_client_free> client_;
};

namespace detail {
inline void close_stream(inferd_stream *s) {
    if (s != nullptr)
        inferd_stream_close(s);
}
}  // namespace detail

// A stream of a model (inferd.h, "streams"; libinferd 0.2): the daemon keeps the model's
// state between its calls. Owns its inferd_stream, closed (in the daemon too) when it
// goes; close() says whether that worked.
//
//   std::int64_t rate = 16000;
//   inferd::Stream vad(client, "vad", {{"sr", INFERD_INT64, 0, nullptr, &rate, 8}});
//   float p = vad.infer("input", chunk, {1, 512}).output("output").at<float>(0);
class Stream {
public:
    // CONSTANTS: the inputs that stay for the whole stream (copied now). ID nullptr: a
    // name the library makes. Throws Error.
    Stream(Client &client, const std::string &model,
           std::initializer_list<inferd_tensor> constants = {}, const char *id = nullptr)
        : client_(client.get()) {
        inferd_code rc = inferd_stream_open(client_, model.c_str(), id, constants.begin(),
                                            constants.size(), stream_.out());
        if (rc != INFERD_OK)
            throw Error(rc, inferd_client_error(client_));
    }
    std::string_view id() const { return inferd_stream_id(stream_.get()); }
    // The next chunk (inputs borrowed until it returns): the completed call. Throws Error;
    // INFERD_FAILED_PRECONDITION when the daemon lost the state (the next call starts it again).
    Call infer(std::initializer_list<inferd_tensor> inputs) {
        inferd_call *raw = nullptr;
        inferd_code rc = inferd_stream_infer(stream_.get(), inputs.begin(), inputs.size(), &raw);
        if (raw == nullptr)
            throw Error(rc, inferd_client_error(client_));
        Call call(raw);
        if (rc != INFERD_OK)
            throw Error(rc, inferd_call_message(raw));
        return call;
    }
    template <class T>
    Call infer(const std::string &name, const std::vector<T> &values,
               std::initializer_list<std::int64_t> shape) {
        return infer({inferd_tensor{name.c_str(), dtype_of<T>::dtype, shape.size(), shape.begin(),
                                    values.data(), values.size() * sizeof(T), nullptr,
                                    nullptr}});
    }
    // The next call starts the stream again (its state back to the model's initial value).
    void reset() noexcept { inferd_stream_reset(stream_.get()); }
    // Frees it in the daemon now; throws Error when that failed (it is gone here anyway).
    void close() {
        inferd_stream *s = std::exchange(*stream_.out(), nullptr);
        if (s == nullptr)
            return;
        inferd_code rc = inferd_stream_close(s);
        if (rc != INFERD_OK)
            throw Error(rc, inferd_client_error(client_));
    }
    inferd_stream *get() const noexcept { return stream_.get(); }

private:
    inferd_client *client_;
    Handle<inferd_stream, detail::close_stream> stream_;
};

}  // namespace inferd

#endif  // INFERD_HPP
